//! The vmnet agent: reconcile loop, HTTP API, audits, root helper.

pub mod pool;
