//! Pool IPAM: leases, placement and the SQLite/PostgreSQL stores (spec:
//! hosted-pool-networking.md, "Give a hosted pool a range", "How leases work").
//!
//! # Design
//! * A pool holds an ordered list of ranges ([`pool_ranges`]): the first IPv4 range in
//!   `ip_pools` (what `set_ip_pool` sets, as before), then the ranges added after it, IPv4 and
//!   IPv6, in `ip_ranges`. One row per IPv4 lease in `ip_leases` and per IPv6 lease in
//!   `ip6_leases`, each with primary key `(pool_id, address)` and a unique `instance_id` (at most
//!   one lease per family per instance). PostgreSQL stores `cidr`/`inet`; SQLite stores text plus
//!   an integer (IPv4) or 16-byte big-endian (IPv6) copy for ordering.
//! * The free addresses of each range are kept as disjoint intervals in `ip_free` (IPv4,
//!   integers) and `ip6_free` (IPv6, 16 bytes big-endian, since a /64 outgrows 64-bit integers),
//!   tagged with the range's position. The lowest free address of the first range with room is
//!   the smallest `(range_seq, first)`: one index seek, whatever the size or fill of the ranges. A lease shrinks (or deletes) that interval; a
//!   release puts the address back, merged with its neighbours; `set_ip_pool` rebuilds the
//!   intervals from the new range minus the gateway minus the existing leases.
//! * Concurrency: on PostgreSQL a placer share-locks the range row and locks the lowest interval
//!   no other placer holds (`FOR UPDATE SKIP LOCKED`), or else queues for the lowest one
//!   (`FOR UPDATE`); either way each takes a distinct address instead of failing. Under
//!   concurrency "lowest" is the lowest among addresses not being taken by a concurrent placer. The lease insert runs in a savepoint; a unique violation (an address taken behind the
//!   index's back) is undone and retried on the next free address, up to 8 times. SQLite
//!   serializes writers (`BEGIN IMMEDIATE`).
//! * Ranges of different pools never overlap: `set_ip_pool` checks the new range against every
//!   other pool's ([`IpRange::clash`]) in its own transaction, with the `ip_pools` table locked
//!   against other range writes on PostgreSQL (`SHARE ROW EXCLUSIVE`, which placements' row
//!   share locks do not wait for); SQLite serializes writers anyway.
//! * Every transaction takes its row locks in one order: hosts, instances, the range, free
//!   intervals, leases (module `locks`). So placements, deletes, host losses and status reports
//!   do not deadlock one another. Should PostgreSQL still fail a transaction with a deadlock or
//!   a serialization conflict, [`transaction!`] and [`retry`] run it again (up to 8 attempts,
//!   jittered pauses under 0.3 s in all); the caller sees [`IpamError::Busy`] only when every
//!   attempt failed so. A database failure ([`IpamError::Database`]) has a sentence of ours as
//!   its message and the driver's error as its source: logged, never answered to a caller.
//! * Errors: one enum, [`IpamError`], in IPAM's own terms; the documented codes are chosen at
//!   the edge that answers (the agent's API, the CLI).
//! * Every function takes the caller's [`Tx`], so a placement's host claim and its lease commit or
//!   roll back together. Composite operations (instance create/delete, host loss) run inside a
//!   savepoint and undo their own writes on error, so a failed call leaves the transaction as it was.
//!
//! * Host status reports add addresses to `Instance.addresses` after the lease
//!   (`instance_addresses`, see [`reports`]).
//! * Provider pools (`provider_pools`, `provider_machines`, see [`providers`]) lease nothing;
//!   their instances are machines whose addresses each poll replaces.
//!
//! # Limitations
//! * Instances placed before their pool got its first range of a family hold no lease of that
//!   family until they are placed again.
//! * DNS servers are the first IPv4 range's (`ip_pools.dns`), for both families.
//! * A release outside the current range (after a range replacement) does not return the address
//!   to the free index; the address becomes leasable again only if a later `set_ip_pool` covers it.
//! * Concurrent releases of neighbouring addresses may leave adjacent intervals unmerged; that
//!   costs rows, never correctness.
//! * Placement picks the first ready host by id with room; there is no spreading or scoring.
//! * A host loss holds every ready host row until it commits (see [`locks`](crate::locks)), so
//!   placements and deletes wait for it.
//! * SQLite serializes all transactions (`BEGIN IMMEDIATE`), readers included.

mod addresses;
pub mod db;
pub mod error;
mod free;
mod free6;
mod instances;
pub mod leases;
pub mod leases6;
mod locks;
pub mod loss;
pub mod mesh_store;
pub mod mesh_vms;
pub mod placement;
pub mod pool_ranges;
pub mod providers;
pub mod ranges;
pub mod reports;
mod stored;
pub mod vm_store;

pub use db::{
    Backend, Db, POSTGRES_MIGRATOR, PgStore, Retry, SQLITE_MIGRATOR, SqliteStore, Store, Tx,
    retried_transactions, retry,
};
pub use error::{BUSY, IpamError, TxError};
pub use instances::lease_net;
pub use leases::{LEASE_ATTEMPTS, bulk_insert_leases, lease, lease_of, list_leases, release};
pub use leases6::{bulk_insert_leases6, lease6, lease6_of, release6};
pub use loss::{HostLoss, lose_host};
pub use placement::{
    Ensured, add_host, create_instance, delete_instance, ensure_instance, get_host, get_instance,
    list_hosts, list_instances,
};
pub use pool_ranges::{add_range, list_ranges, remove_range};
pub use providers::{
    MachinePoll, list_provider_pools, mark_pool_stale, provider_machines, record_poll,
    set_provider_pool,
};
pub use ranges::{create_pool, get_ip_pool, get_pool, list_pools, set_ip_pool};
pub use reports::report_host_status;
pub use vmnet_model::pool::{
    AddRange, Condition, Credentials, Family, Host, HostState, Instance, InstanceState, IpRange,
    Lease, Machine, NetworkPolicy, NewInstance, Pool, PoolKind, PoolRange, Provider, ProviderPool,
    ReportedInstance, SetIpPool, SetProviderPool, SkipReason, SkippedInstance, StatusReport,
    StatusReportOutcome, UpdatedInstance,
};
