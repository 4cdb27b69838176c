//! The per-VM network config of namespace mode (spec: namespaced-vm-networking.md, "Routes").
