//! Pool IPAM: leases, placement and the SQLite/PostgreSQL stores.
