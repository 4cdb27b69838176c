-- Pool IPAM (PostgreSQL): pools, ranges, leases and the free-interval index.
-- Addresses are cidr/inet so that operators can query them with host(), ORDER BY address, etc.

CREATE TABLE pools (
    pool_id TEXT PRIMARY KEY
);

CREATE TABLE ip_pools (
    pool_id    TEXT PRIMARY KEY REFERENCES pools (pool_id),
    cidr       CIDR NOT NULL,
    gateway    INET NOT NULL,
    first_host INET NOT NULL,
    last_host  INET NOT NULL,
    dns        INET[] NOT NULL DEFAULT '{}'
);

CREATE TABLE ip_leases (
    pool_id     TEXT NOT NULL REFERENCES pools (pool_id),
    address     INET NOT NULL,
    instance_id TEXT NOT NULL UNIQUE,
    PRIMARY KEY (pool_id, address)
);

-- Free addresses of each pool's range as disjoint intervals [first, last], as integers
-- (address - '0.0.0.0'::inet); the lowest free address is the smallest `first`.
-- Kept equal to: range - gateway - leases.
CREATE TABLE ip_free (
    pool_id TEXT NOT NULL REFERENCES pools (pool_id),
    first   BIGINT NOT NULL,
    last    BIGINT NOT NULL,
    PRIMARY KEY (pool_id, first)
);
CREATE INDEX ip_free_by_last ON ip_free (pool_id, last);

CREATE TABLE hosts (
    host_id         TEXT PRIMARY KEY,
    vcpus           BIGINT NOT NULL CHECK (vcpus > 0),
    memory_mib      BIGINT NOT NULL CHECK (memory_mib > 0),
    used_vcpus      BIGINT NOT NULL DEFAULT 0 CHECK (used_vcpus >= 0 AND used_vcpus <= vcpus),
    used_memory_mib BIGINT NOT NULL DEFAULT 0 CHECK (used_memory_mib >= 0 AND used_memory_mib <= memory_mib),
    state           TEXT NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'lost'))
);

CREATE TABLE instances (
    instance_id           TEXT PRIMARY KEY,
    pool_id               TEXT NOT NULL REFERENCES pools (pool_id),
    host_id               TEXT REFERENCES hosts (host_id),
    vcpus                 BIGINT NOT NULL CHECK (vcpus > 0),
    memory_mib            BIGINT NOT NULL CHECK (memory_mib > 0),
    recreate_on_host_loss BOOLEAN NOT NULL DEFAULT FALSE,
    state                 TEXT NOT NULL CHECK (state IN ('running', 'lost', 'error')),
    conditions            TEXT NOT NULL DEFAULT '[]' -- JSON array of {type, message}
);
CREATE INDEX instances_by_host ON instances (host_id);
