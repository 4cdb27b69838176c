-- Pool IPAM (SQLite): pools, ranges, leases and the free-interval index.
-- Addresses are stored as dotted-quad TEXT (canonical, so the text is unique per address) plus an
-- INTEGER copy for ordering and range arithmetic.

CREATE TABLE pools (
    pool_id TEXT PRIMARY KEY NOT NULL
);

CREATE TABLE ip_pools (
    pool_id        TEXT PRIMARY KEY NOT NULL REFERENCES pools (pool_id),
    cidr           TEXT NOT NULL,
    gateway        TEXT NOT NULL,
    first_host     TEXT NOT NULL,
    last_host      TEXT NOT NULL,
    dns            TEXT NOT NULL DEFAULT '[]', -- JSON array of address strings
    first_host_num INTEGER NOT NULL,
    last_host_num  INTEGER NOT NULL,
    gateway_num    INTEGER NOT NULL
);

CREATE TABLE ip_leases (
    pool_id     TEXT NOT NULL REFERENCES pools (pool_id),
    address     TEXT NOT NULL,
    address_num INTEGER NOT NULL,
    instance_id TEXT NOT NULL UNIQUE,
    PRIMARY KEY (pool_id, address)
);
CREATE INDEX ip_leases_by_num ON ip_leases (pool_id, address_num);

-- Free addresses of each pool's range as disjoint intervals [first, last] (integers); the lowest
-- free address is the smallest `first`. Kept equal to: range - gateway - leases.
CREATE TABLE ip_free (
    pool_id TEXT NOT NULL REFERENCES pools (pool_id),
    first   INTEGER NOT NULL,
    last    INTEGER NOT NULL,
    PRIMARY KEY (pool_id, first)
);
CREATE INDEX ip_free_by_last ON ip_free (pool_id, last);

CREATE TABLE hosts (
    host_id         TEXT PRIMARY KEY NOT NULL,
    vcpus           INTEGER NOT NULL CHECK (vcpus > 0),
    memory_mib      INTEGER NOT NULL CHECK (memory_mib > 0),
    used_vcpus      INTEGER NOT NULL DEFAULT 0 CHECK (used_vcpus >= 0 AND used_vcpus <= vcpus),
    used_memory_mib INTEGER NOT NULL DEFAULT 0 CHECK (used_memory_mib >= 0 AND used_memory_mib <= memory_mib),
    state           TEXT NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'lost'))
);

CREATE TABLE instances (
    instance_id           TEXT PRIMARY KEY NOT NULL,
    pool_id               TEXT NOT NULL REFERENCES pools (pool_id),
    host_id               TEXT REFERENCES hosts (host_id),
    vcpus                 INTEGER NOT NULL CHECK (vcpus > 0),
    memory_mib            INTEGER NOT NULL CHECK (memory_mib > 0),
    recreate_on_host_loss INTEGER NOT NULL DEFAULT 0,
    state                 TEXT NOT NULL CHECK (state IN ('running', 'lost', 'error')),
    conditions            TEXT NOT NULL DEFAULT '[]' -- JSON array of {type, message}
);
CREATE INDEX instances_by_host ON instances (host_id);
