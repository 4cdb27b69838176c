-- Provider pools (spec: hosted-pool-networking.md, the table of pools, "Provider"; "Addresses on
-- an instance", provider pools), owned by vmnet_ipam::providers. A pool with a row here is a
-- provider pool: it has no ip_pools row and leases nothing. The credentials columns hold where
-- the agent reads the secret (a file path or an environment variable name), exactly one of
-- them; the secret itself is never stored.
CREATE TABLE provider_pools (
    pool_id            TEXT PRIMARY KEY REFERENCES pools (pool_id),
    provider           TEXT NOT NULL CHECK (provider IN ('hetzner-cloud', 'proxmox-ve')),
    api_url            TEXT NOT NULL,
    credentials_file   TEXT,
    credentials_env    TEXT,
    poll_interval_secs BIGINT NOT NULL CHECK (poll_interval_secs > 0),
    CHECK ((credentials_file IS NULL) <> (credentials_env IS NULL))
);
-- The machine of each instance of a provider pool (a Hetzner Cloud server id, or a Proxmox VE
-- node and vmid; vmids are unique in a Proxmox cluster) and what the last good poll reported:
-- addresses is a JSON array of CIDR text, replaced as a whole by every poll; polled_at is when
-- that poll finished (ms since the Unix epoch, NULL before the first); stale is true when a
-- later poll failed (the addresses are the last good ones).
CREATE TABLE provider_machines (
    instance_id TEXT PRIMARY KEY REFERENCES instances (instance_id) ON DELETE CASCADE,
    pool_id     TEXT NOT NULL REFERENCES pools (pool_id),
    server_id   BIGINT,
    node        TEXT,
    vmid        BIGINT,
    addresses   TEXT NOT NULL DEFAULT '[]',
    polled_at   BIGINT,
    stale       BOOLEAN NOT NULL DEFAULT FALSE,
    CHECK ((server_id IS NULL) <> (node IS NULL AND vmid IS NULL)),
    UNIQUE (pool_id, server_id),
    UNIQUE (pool_id, vmid)
);
CREATE INDEX provider_machines_by_pool ON provider_machines (pool_id, instance_id);
