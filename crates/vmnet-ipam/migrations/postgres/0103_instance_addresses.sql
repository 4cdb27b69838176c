-- Addresses a host status report added to an instance (spec: hosted-pool-networking.md,
-- "Addresses on an instance", hosted pools), in arrival order. `Instance.addresses` is the lease
-- (from ip_leases, not repeated here) followed by these rows ordered by seq. Reports only add:
-- (instance_id, address) is unique, and a row is never updated. The rows go with the instance
-- (ON DELETE CASCADE) and are cleared when a host loss takes the instance off its host (they
-- came from the old machine). address is inet: the interface address with its prefix length
-- (host bits kept, e.g. 10.0.0.2/29 or 2001:db8::5/64); text(address) gives it back in that form.
-- seq comes from an identity column, so concurrent reports never collide on it.
CREATE TABLE instance_addresses (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance_id TEXT NOT NULL REFERENCES instances (instance_id) ON DELETE CASCADE,
    address     INET NOT NULL,
    UNIQUE (instance_id, address)
);
CREATE INDEX instance_addresses_by_instance ON instance_addresses (instance_id, seq);
