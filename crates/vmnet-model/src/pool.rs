//! Pool ranges, leases, hosts and instances (spec: hosted-pool-networking.md, "Give a hosted pool a range", "How leases work").
