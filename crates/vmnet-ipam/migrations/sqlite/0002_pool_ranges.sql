-- A pool's ordered list of ranges, IPv4 and IPv6, and IPv6 leases (spec:
-- hosted-pool-networking.md; issue 48). The first IPv4 range stays in ip_pools (position 0),
-- so stores migrate without touching a row and the operator SQL on ip_pools and ip_leases reads
-- IPv4 exactly as before. Ranges added after it live in ip_ranges with positions 1, 2, … in the
-- pool's order (never reused; a removed range leaves a gap).
CREATE TABLE ip_ranges (
    pool_id    TEXT NOT NULL REFERENCES pools (pool_id),
    seq        INTEGER NOT NULL CHECK (seq > 0),
    family     INTEGER NOT NULL CHECK (family IN (4, 6)),
    cidr       TEXT NOT NULL,
    gateway    TEXT NOT NULL,
    first_host TEXT NOT NULL,
    last_host  TEXT NOT NULL,
    PRIMARY KEY (pool_id, seq)
);

-- The free IPv4 intervals say which range they belong to (0: the first range), so the lowest
-- free address of the first range with room is one index seek on (pool_id, range_seq, first).
-- A release merges with the interval of its range that ends just below it: one seek on
-- (pool_id, range_seq, last), which replaces the index on (pool_id, last).
ALTER TABLE ip_free ADD COLUMN range_seq INTEGER NOT NULL DEFAULT 0;
CREATE INDEX ip_free_by_range ON ip_free (pool_id, range_seq, first);
DROP INDEX ip_free_by_last;
CREATE INDEX ip_free_by_last ON ip_free (pool_id, range_seq, last);

-- IPv6 leases: at most one per instance (instance_id is unique), like ip_leases for IPv4.
-- address is the canonical text (RFC 5952), address_bytes the 16 bytes big-endian, which sort
-- like the addresses.
CREATE TABLE ip6_leases (
    pool_id       TEXT NOT NULL REFERENCES pools (pool_id),
    address       TEXT NOT NULL,
    address_bytes BLOB NOT NULL CHECK (length(address_bytes) = 16),
    instance_id   TEXT NOT NULL UNIQUE,
    PRIMARY KEY (pool_id, address)
);
CREATE INDEX ip6_leases_by_bytes ON ip6_leases (pool_id, address_bytes);

-- Free IPv6 addresses of each range as disjoint intervals [first, last] of 16-byte big-endian
-- values (a /64 has 2^64 addresses, more than an INTEGER holds). Kept equal to: range - gateway
-- - leases.
CREATE TABLE ip6_free (
    pool_id   TEXT NOT NULL REFERENCES pools (pool_id),
    range_seq INTEGER NOT NULL,
    first     BLOB NOT NULL CHECK (length(first) = 16),
    last      BLOB NOT NULL CHECK (length(last) = 16),
    PRIMARY KEY (pool_id, first)
);
CREATE INDEX ip6_free_by_range ON ip6_free (pool_id, range_seq, first);
CREATE INDEX ip6_free_by_last ON ip6_free (pool_id, range_seq, last);
