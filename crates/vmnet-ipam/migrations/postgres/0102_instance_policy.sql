-- Per-instance network policy and sandbox flag (spec: hosted-pool-networking.md, "bcd's nftables
-- tables"), and the allocation id of the instance's latest placement. Existing rows read as
-- policy 'public', sandbox off, and keep their instance id as allocation id (what the agent used
-- before these columns existed), so running instances keep their allocation across the upgrade.
ALTER TABLE instances ADD COLUMN network_policy TEXT NOT NULL DEFAULT 'public'
    CHECK (network_policy IN ('public', 'private', 'none'));
ALTER TABLE instances ADD COLUMN sandbox BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE instances ADD COLUMN allocation_id TEXT NOT NULL DEFAULT '';
UPDATE instances SET allocation_id = instance_id;
-- Every placement takes the next number (never reused, even after a delete). A sequence, not a
-- counter row: concurrent placements must not serialize (or deadlock) on one row.
CREATE SEQUENCE allocation_seq START 1;
