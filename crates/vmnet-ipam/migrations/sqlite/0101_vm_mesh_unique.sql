-- A VM's mesh address (mesh_ipv6 of its config, canonical text; NULL when the VM has none) in
-- its own column, unique: two VMs with one mesh address would fight over the host route to it.
-- Existing rows are backfilled from their config; when rows already share an address, only the
-- one with the smallest id keeps it (the others get it back on their next PUT, which then fails
-- with CONFLICT instead of silently taking the route over).
ALTER TABLE vm_configs ADD COLUMN mesh TEXT;
UPDATE vm_configs SET mesh = json_extract(config, '$.mesh_ipv6')
WHERE json_extract(config, '$.mesh_ipv6') IS NOT NULL
  AND id = (SELECT MIN(o.id) FROM vm_configs o
            WHERE json_extract(o.config, '$.mesh_ipv6') = json_extract(vm_configs.config, '$.mesh_ipv6'));
CREATE UNIQUE INDEX vm_configs_mesh_unique ON vm_configs (mesh);
