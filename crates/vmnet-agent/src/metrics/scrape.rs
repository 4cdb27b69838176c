//! One scrape: a snapshot of what the agent keeps ([`Snapshot`]), taken once per request, and
//! its encoding with the histograms of [`super::AgentMetrics`] in the Prometheus text format.
//! Every metric is listed, with its labels, in the book's Metrics and health page.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use vmnet_ipam::vm_store::{self, VmState};
use vmnet_plan::ns::limits::{Direction, TrafficClass};

use crate::agent::{Agent, store_tx};
use crate::metadata::serve::Counts;
use crate::provider::poller::PollCounts;
use crate::status::{FirewallAuditStatus, ReconcileStatus};

/// The `Content-Type` of a scrape's answer.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The idle thresholds of `vmnet_activity_idle_vms`, seconds.
pub const IDLE_THRESHOLDS: [(u64, &str); 4] =
    [(60, "60"), (600, "600"), (3600, "3600"), (86_400, "86400")];

/// One of a VM's limit classes: direction, class, bytes, packets, drops.
type ClassRow = (&'static str, &'static str, u64, u64, u64);

/// What one scrape reports besides the histograms.
#[derive(Debug, Default)]
struct Snapshot {
    version: String,
    /// Applied, pending, failed; `None` when the store did not answer.
    vms: Option<[u64; 3]>,
    reconcile: ReconcileStatus,
    repairs: BTreeMap<(&'static str, &'static str), u64>,
    pool_table_repairs: Option<u64>,
    firewall: FirewallAuditStatus,
    /// (mode, kind, frames).
    spoofs: Vec<(&'static str, String, u64)>,
    /// Per VM with a limit in force (by id), its classes by direction and class.
    classes: Vec<(String, Vec<ClassRow>)>,
    /// (vm, idle seconds); `None` when activity is off.
    idle: Option<Vec<(String, u64)>>,
    /// Wake on packet's counters; `None` when it is off.
    wake: Option<crate::wake::Totals>,
    /// (peer public key, seconds since its last handshake or `None`); `None` without the mesh.
    mesh: Option<Vec<(String, Option<u64>)>>,
    metadata: Option<Counts>,
    /// (pool, used, free).
    leases: Vec<(String, u64, u64)>,
    providers: Vec<PollCounts>,
    store_errors: u64,
    kernel_timeouts: u64,
    worker_starts: Option<u64>,
}

fn class_name(c: TrafficClass) -> &'static str {
    match c {
        TrafficClass::Private => "private",
        TrafficClass::Public => "public",
    }
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Download => "download",
        Direction::Upload => "upload",
    }
}

fn secs_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Agent {
    /// The body of `GET /metrics`: every metric, in the Prometheus text format.
    pub async fn metrics_text(&self) -> String {
        let snap = self.snapshot().await;
        let mut reg = Registry::default();
        reg.register(
            "vmnet_vm_apply_duration_seconds",
            "Time a VM change through the API took under the kernel lock (checks, kernel apply, store write), by kind",
            self.metrics.apply.clone(),
        );
        reg.register(
            "vmnet_reconcile_pass_duration_seconds",
            "Time a reconcile pass took, by pass (full or change)",
            self.metrics.passes.clone(),
        );
        reg.register_collector(Box::new(snap));
        // Sized from the last scrape's body, so that a large one is not copied as it grows.
        let last = self.metrics.last_scrape_bytes.load(Ordering::Relaxed);
        let mut out = String::with_capacity((last + last / 8).max(64 * 1024));
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &reg) {
            tracing::warn!("encoding the metrics failed: {e}");
        }
        self.metrics
            .last_scrape_bytes
            .store(out.len(), Ordering::Relaxed);
        out
    }

    async fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            reconcile: self.record.lock().map(|r| r.clone()).unwrap_or_default(),
            repairs: self.metrics.repairs(),
            firewall: self.firewall_status(),
            kernel_timeouts: self.kernel.status().timeouts_total,
            ..Snapshot::default()
        };
        // The store once: the VMs' states (not their configs) and the pools, in one
        // transaction.
        let stored = store_tx!(self.db(), tx => async {
            let vms = vm_store::states(tx).await?;
            let pools = vmnet_ipam::list_pools(tx).await?;
            Ok::<_, vmnet_ipam::IpamError>((vms, pools))
        }.await);
        let rows = match stored {
            Ok((rows, pools)) => {
                s.leases = pools
                    .into_iter()
                    .filter_map(|p| {
                        let size = p.range.as_ref()?.size();
                        Some((p.pool_id, p.leases, size.saturating_sub(p.leases)))
                    })
                    .collect();
                let mut counts = [0u64; 3];
                for (.., state) in &rows {
                    counts[match state {
                        VmState::Applied => 0,
                        VmState::Pending => 1,
                        VmState::Failed => 2,
                    }] += 1;
                }
                s.vms = Some(counts);
                rows
            }
            Err(e) => {
                tracing::warn!("metrics: the store did not answer: {e}");
                Vec::new()
            }
        };
        s.store_errors = super::store_errors();
        // In the store's order (by id), each VM's classes by direction and class.
        let mut kept = self.driver().kept_limit_counters();
        for (id, uid, _) in &rows {
            let Some(counters) = kept.remove(uid) else {
                continue;
            };
            let mut classes: Vec<ClassRow> = counters
                .into_iter()
                .filter(|c| c.applied)
                .map(|c| {
                    (
                        direction_name(c.direction),
                        class_name(c.class),
                        c.bytes,
                        c.packets,
                        c.drops,
                    )
                })
                .collect();
            classes.sort_unstable();
            s.classes.push((id.clone(), classes));
        }
        if let Ok(Some(t)) = self.driver().guard_totals() {
            for (k, n) in t.drops {
                s.spoofs.push(("namespace", k.to_owned(), n));
            }
            s.spoofs
                .push(("namespace", "unregistered".to_owned(), t.unregistered));
        }
        if let Some(p) = self.pool() {
            if let Some(g) = p.guard_status() {
                for (k, n) in g.drops {
                    s.spoofs.push(("pool", k, n));
                }
            }
            s.pool_table_repairs = Some(p.runtime().status().drift_repairs);
        }
        s.wake = self.wake_service().map(|w| w.totals());
        if let Some(rec) = self.activity_recorder() {
            match rec.last_of_each(rows.iter().map(|(_, uid, _)| *uid)) {
                Ok(last) => {
                    let now = SystemTime::now();
                    s.idle = Some(
                        rows.iter()
                            .map(|(id, uid, _)| {
                                let idle = crate::activity::idle_secs(
                                    last.get(uid).copied(),
                                    self.activity_baseline(*uid),
                                    now,
                                );
                                (id.clone(), idle)
                            })
                            .collect(),
                    );
                }
                Err(e) => tracing::warn!("metrics: reading the activity map failed: {e}"),
            }
        }
        if let Ok(m) = self.mesh() {
            let now = secs_since_epoch(SystemTime::now());
            s.mesh = Some(
                m.handshakes()
                    .into_iter()
                    .map(|(k, at)| (k, (at != 0).then(|| now.saturating_sub(at))))
                    .collect(),
            );
        }
        if let Some(w) = self.worker_handle() {
            s.metadata = Some(w.metadata_counts());
            s.worker_starts = Some(w.status().starts);
        }
        if let Some(p) = self.provider_poller() {
            s.providers = p.counts();
        }
        s
    }
}

/// Writes one family of constant metrics (`counter` or `gauge`), one sample per row; nothing
/// when `rows` is empty.
fn family<L: EncodeLabelSet, V>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    counter: bool,
    rows: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error>
where
    ConstCounter<V>: EncodeMetric,
    ConstGauge<V>: EncodeMetric,
{
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let ty = if counter {
        MetricType::Counter
    } else {
        MetricType::Gauge
    };
    let mut me = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in rows {
        let fam = me.encode_family(&labels)?;
        if counter {
            ConstCounter::new(v).encode(fam)?;
        } else {
            ConstGauge::new(v).encode(fam)?;
        }
    }
    Ok(())
}

/// One sample without labels.
fn single(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    counter: bool,
    v: u64,
) -> Result<(), std::fmt::Error> {
    family::<[(&str, &str); 0], u64>(enc, name, help, counter, [([], v)])
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut enc;
        family(
            e,
            "vmnet_build_info",
            "The agent's version (always 1)",
            false,
            [([("version", self.version.as_str())], 1u64)],
        )?;
        if let Some([applied, pending, failed]) = self.vms {
            family(
                e,
                "vmnet_vms",
                "Stored VMs by state: applied, pending (not applied yet), failed (last apply failed)",
                false,
                [
                    ([("state", "applied")], applied),
                    ([("state", "pending")], pending),
                    ([("state", "failed")], failed),
                ],
            )?;
        }
        let r = &self.reconcile;
        single(
            e,
            "vmnet_reconcile_passes",
            "Reconcile passes finished since the agent started",
            true,
            r.passes,
        )?;
        single(
            e,
            "vmnet_reconcile_last_pass_errors",
            "Errors of the last reconcile pass (VMs or objects it could not converge)",
            false,
            r.last_errors.len() as u64,
        )?;
        single(
            e,
            "vmnet_orphans_removed",
            "Orphaned kernel objects (user ids) removed since the agent started",
            true,
            r.orphans_removed_total,
        )?;
        let mut repairs: Vec<([(&str, &str); 2], u64)> = self
            .repairs
            .iter()
            .map(|((o, t), n)| ([("object", *o), ("trigger", *t)], *n))
            .collect();
        if let Some(n) = self.pool_table_repairs {
            repairs.push(([("object", "pool"), ("trigger", "audit")], n));
        }
        family(
            e,
            "vmnet_drift_repairs",
            "Kernel state changed behind the agent's back and put back, by object (host, vm, mesh, pool) and trigger (pass, notification, audit)",
            true,
            repairs,
        )?;
        let n = &r.notifications;
        if n.on {
            single(
                e,
                "vmnet_kernel_notifications",
                "Kernel change notifications of vmnet's objects received",
                true,
                n.events_total,
            )?;
            single(
                e,
                "vmnet_kernel_notifications_lost",
                "Times kernel notifications were lost (a full pass followed)",
                true,
                n.lost_total,
            )?;
        }
        let f = &self.firewall;
        single(
            e,
            "vmnet_firewall_audits",
            "Firewall audits run since the agent started",
            true,
            f.audits,
        )?;
        single(
            e,
            "vmnet_firewall_repairs",
            "VM filter tables replaced because they were changed behind the agent's back (by the audit or a pass)",
            true,
            f.repairs_total,
        )?;
        let spoofs: Vec<([(&str, &str); 2], u64)> = self
            .spoofs
            .iter()
            .map(|(m, k, n)| ([("mode", *m), ("kind", k.as_str())], *n))
            .collect();
        family(
            e,
            "vmnet_spoof_drops",
            "Frames a guest sent that the guard on its tap dropped, by mode (namespace: the guest guard; pool: the tap guard) and kind",
            true,
            spoofs,
        )?;
        self.encode_classes(e)?;
        if let Some(idle) = &self.idle {
            let counts: Vec<([(&str, &str); 1], u64)> = IDLE_THRESHOLDS
                .iter()
                .map(|(secs, label)| {
                    let n = idle.iter().filter(|(_, s)| s >= secs).count() as u64;
                    ([("idle_for_seconds", *label)], n)
                })
                .collect();
            family(
                e,
                "vmnet_activity_idle_vms",
                "VMs without packet activity for at least idle_for_seconds",
                false,
                counts,
            )?;
            let per_vm = idle.iter().map(|(vm, s)| ([("vm", vm.as_str())], *s));
            family(
                e,
                "vmnet_vm_idle_seconds",
                "Seconds since the VM's last packet (or since the agent started or created it)",
                false,
                per_vm,
            )?;
        }
        if let Some(w) = &self.wake {
            single(
                e,
                "vmnet_wake_events",
                "vm_wake events: packets that counted as activity for a VM whose tap had no VMM",
                true,
                w.wakes,
            )?;
            let frames: Vec<([(&str, &str); 1], u64)> = [
                ("held", w.held),
                ("delivered", w.delivered),
                ("dropped", w.dropped),
                ("lost", w.lost),
            ]
            .into_iter()
            .map(|(k, n)| ([("outcome", k)], n))
            .collect();
            family(
                e,
                "vmnet_wake_frames",
                "Frames for sleeping VMs: held, delivered when the VMM attached, dropped (bounds, hold time, too long, refused), lost (the kernel's buffers full)",
                true,
                frames,
            )?;
            single(
                e,
                "vmnet_wake_hook_failures",
                "Wake hook calls that failed or were not answered within 1 s",
                true,
                w.hook_failures,
            )?;
        }
        if let Some(peers) = &self.mesh {
            single(
                e,
                "vmnet_mesh_peers",
                "Peers on the mesh's WireGuard device",
                false,
                peers.len() as u64,
            )?;
            let ages: Vec<([(&str, &str); 1], u64)> = peers
                .iter()
                .filter_map(|(k, age)| Some(([("peer", k.as_str())], (*age)?)))
                .collect();
            family(
                e,
                "vmnet_mesh_peer_handshake_age_seconds",
                "Seconds since the peer's last WireGuard handshake (peers that never made one are left out)",
                false,
                ages,
            )?;
        }
        if let Some(m) = &self.metadata {
            let codes: Vec<String> = m.requests.keys().map(ToString::to_string).collect();
            let rows: Vec<([(&str, &str); 1], u64)> = codes
                .iter()
                .zip(m.requests.values())
                .map(|(c, n)| ([("status", c.as_str())], *n))
                .collect();
            family(
                e,
                "vmnet_metadata_requests",
                "Metadata service requests answered, by HTTP status",
                true,
                rows,
            )?;
            single(
                e,
                "vmnet_metadata_refused_connections",
                "Metadata connections refused because the VM had too many open",
                true,
                m.refused,
            )?;
        }
        if let Some(n) = self.worker_starts {
            single(
                e,
                "vmnet_worker_starts",
                "Unprivileged worker processes started (1 + restarts)",
                true,
                n,
            )?;
        }
        let leases: Vec<([(&str, &str); 2], u64)> = self
            .leases
            .iter()
            .flat_map(|(p, used, free)| {
                [
                    ([("pool", p.as_str()), ("state", "used")], *used),
                    ([("pool", p.as_str()), ("state", "free")], *free),
                ]
            })
            .collect();
        family(
            e,
            "vmnet_pool_leases",
            "Addresses of each hosted pool's range, by state (used: leased; free)",
            false,
            leases,
        )?;
        let providers: Vec<String> = self
            .providers
            .iter()
            .map(|p| p.provider.to_string())
            .collect();
        let polls: Vec<([(&str, &str); 2], u64)> = self
            .providers
            .iter()
            .zip(&providers)
            .map(|(p, k)| {
                (
                    [("pool", p.pool_id.as_str()), ("provider", k.as_str())],
                    p.polls,
                )
            })
            .collect();
        family(
            e,
            "vmnet_provider_polls",
            "Provider pool polls finished, by pool",
            true,
            polls,
        )?;
        let failures: Vec<([(&str, &str); 2], u64)> = self
            .providers
            .iter()
            .zip(&providers)
            .map(|(p, k)| {
                (
                    [("pool", p.pool_id.as_str()), ("provider", k.as_str())],
                    p.failures,
                )
            })
            .collect();
        family(
            e,
            "vmnet_provider_poll_failures",
            "Provider pool polls that failed (machines kept their last good addresses, marked stale), by pool",
            true,
            failures,
        )?;
        single(
            e,
            "vmnet_store_errors",
            "Store operations that failed because the store did not answer or was corrupt",
            true,
            self.store_errors,
        )?;
        single(
            e,
            "vmnet_kernel_deadline_timeouts",
            "VM changes through the API that ran out of the kernel deadline",
            true,
            self.kernel_timeouts,
        )?;
        Ok(())
    }
}

impl Snapshot {
    fn encode_classes(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rows = |f: fn(&ClassRow) -> u64| {
            self.classes.iter().flat_map(move |(vm, classes)| {
                classes.iter().map(move |r| {
                    let (d, c, ..) = *r;
                    ([("vm", vm.as_str()), ("direction", d), ("class", c)], f(r))
                })
            })
        };
        family(
            e,
            "vmnet_vm_bytes",
            "Bytes of IP packets through the VM's throughput-limit class, by direction (download: to the guest) and class (private, public); VMs with a limit in force",
            true,
            rows(|r| r.2),
        )?;
        family(
            e,
            "vmnet_vm_packets",
            "Packets through the VM's throughput-limit class, by direction and class",
            true,
            rows(|r| r.3),
        )?;
        family(
            e,
            "vmnet_vm_dropped_packets",
            "Packets the VM's throughput-limit class dropped (its queue was full), by direction and class",
            true,
            rows(|r| r.4),
        )
    }
}
