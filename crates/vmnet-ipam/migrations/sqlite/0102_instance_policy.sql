-- Per-instance network policy and sandbox flag (spec: hosted-pool-networking.md, "bcd's nftables
-- tables"), and the allocation id of the instance's latest placement. Existing rows read as
-- policy 'public', sandbox off, and keep their instance id as allocation id (what the agent used
-- before these columns existed), so running instances keep their allocation across the upgrade.
ALTER TABLE instances ADD COLUMN network_policy TEXT NOT NULL DEFAULT 'public'
    CHECK (network_policy IN ('public', 'private', 'none'));
ALTER TABLE instances ADD COLUMN sandbox INTEGER NOT NULL DEFAULT 0;
ALTER TABLE instances ADD COLUMN allocation_id TEXT NOT NULL DEFAULT '';
UPDATE instances SET allocation_id = instance_id;
-- Every placement takes the next number (never reused, even after a delete).
CREATE TABLE allocation_counter (
    id   INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    next INTEGER NOT NULL
);
INSERT INTO allocation_counter (id, next) VALUES (1, 1);
