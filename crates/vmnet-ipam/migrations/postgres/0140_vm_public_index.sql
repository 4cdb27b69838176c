-- A VM's public addresses in their own indexed columns, so the uniqueness check of a PUT reads
-- the few rows that could conflict instead of every stored config: public_v4 (public_ipv4 as
-- text), public_v6_lo and public_v6_hi (the first and last address of public_ipv6, an address
-- or a block, as 32 lowercase hex digits, compared bytewise (COLLATE "C") so text order is
-- address order). Written by the store from the config on every write. public_v4 is
-- backfilled here; rows with a public_ipv6 keep public_v6_lo NULL until their next write and
-- are compared from their config meanwhile.
ALTER TABLE vm_configs ADD COLUMN public_v4 TEXT;
ALTER TABLE vm_configs ADD COLUMN public_v6_lo TEXT COLLATE "C";
ALTER TABLE vm_configs ADD COLUMN public_v6_hi TEXT COLLATE "C";
UPDATE vm_configs SET public_v4 = (config::jsonb ->> 'public_ipv4');
CREATE INDEX vm_configs_public_v4 ON vm_configs (public_v4);
CREATE INDEX vm_configs_public_v6 ON vm_configs (public_v6_lo);
