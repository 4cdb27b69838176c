//! NIC types for pool mode (spec: hosted-pool-networking.md, "What reaches the host").
