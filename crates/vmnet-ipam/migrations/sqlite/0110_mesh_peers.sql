-- The mesh's WireGuard peers the agent applied to wg0 (owned by the agent, vmnet_ipam::mesh_store).
-- public_key: base64; endpoint: address:port (IPv6 in brackets); mesh_address: canonical IPv6
-- text, the peer's only allowed IP and the destination of its /128 route; leaving: 1 when the
-- peer left the managed set and its removal from wg0 is not confirmed yet (the row goes then).
-- Peers on wg0 without a row here are foreign and never touched.
CREATE TABLE mesh_peers (
    public_key   TEXT PRIMARY KEY NOT NULL,
    endpoint     TEXT NOT NULL,
    mesh_address TEXT NOT NULL,
    leaving      INTEGER NOT NULL DEFAULT 0,
    updated_at   BIGINT NOT NULL
);
-- The tenant-0 whitelist of the last sync: IPv6 prefixes in fdaa::/16, canonical text.
CREATE TABLE mesh_whitelist (
    entry TEXT PRIMARY KEY NOT NULL
);
