-- The mesh's VM registrations (owned by the agents of the fleet, vmnet_ipam::mesh_vms): where
-- each VM lives. host: the registering host's mesh address (canonical IPv6 text), its identity
-- in the mesh; each host writes only its own rows. mesh_address: the VM's mesh address;
-- user_id: the VM's user id on that host (the flow label of packets for it); tenant: its tenant
-- (0 is privileged); public_block: its public IPv6 block (canonical prefix text) or NULL;
-- gateway: 1 when the VM serves as a gateway (a route's via); registered_at: milliseconds since
-- the Unix epoch of the claim's first registration (kept when the row is rewritten), which
-- decides between conflicting claims of one mesh address (oldest first, then host).
CREATE TABLE mesh_vms (
    host          TEXT NOT NULL,
    mesh_address  TEXT NOT NULL,
    user_id       BIGINT NOT NULL,
    tenant        BIGINT NOT NULL,
    public_block  TEXT,
    gateway       BIGINT NOT NULL DEFAULT 0,
    registered_at BIGINT NOT NULL,
    PRIMARY KEY (host, mesh_address)
);
CREATE INDEX mesh_vms_by_address ON mesh_vms (mesh_address);
-- Every change notifies channel vmnet_mesh_vms at commit, so peers re-read at once
-- (LISTEN/NOTIFY); a peer that missed one converges on its next reconcile pass.
CREATE FUNCTION vmnet_mesh_vms_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('vmnet_mesh_vms', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER mesh_vms_notify AFTER INSERT OR UPDATE OR DELETE ON mesh_vms
    FOR EACH STATEMENT EXECUTE FUNCTION vmnet_mesh_vms_notify();
