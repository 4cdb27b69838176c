//! Test-only helpers: sandbox namespaces, cleanup guards, traffic checks, PostgreSQL cluster.

pub mod postgres;
