//! `vmnet bench nft`: pool-mode ruleset apply and per-instance add/remove cost.
//!
//! For each K (default 10, 100, 1000 NICs) in its own throwaway namespace: the three bcd tables
//! applied from scratch, a full replace of all three with K present, and one instance added and
//! removed as an element batch with K present (median and p90 of `--reps` rounds), all through
//! one libnftables context held in the namespace, as the root helper holds it. Also the
//! read-back (listing + census) the drift audit pays. Then the tap guard's share of an instance
//! add/remove with K guarded taps on a bridge in the same namespace: attaching it to a new tap
//! (map writes, clsact qdisc, two `cls_bpf` filters) and forgetting it. Prints a table (or JSON
//! with `--output json`).

use std::time::{Duration, Instant};

use serde::Serialize;
use vmnet_kernel::pool::firewall::{NftExec, PoolFirewall};
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_model::Error;
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec, NodeSpec};
use vmnet_plan::pool::nft::{HostAddrs, plan, render_full};

use crate::{Global, Output};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct NftBenchArgs {
    /// Numbers of instance NICs to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    pub sizes: Vec<usize>,
    /// Rounds of add/remove per size (median and p90 reported).
    #[arg(long, default_value_t = 50)]
    pub reps: usize,
}

/// One row of the result.
#[derive(Debug, Clone, Serialize)]
pub struct NftBenchRow {
    /// NICs present.
    pub k: usize,
    /// Rules in the three tables (fixed, whatever K).
    pub rules: usize,
    /// JSON size of the full replace, bytes.
    pub full_bytes: usize,
    /// Apply of the three tables from scratch, ms.
    pub scratch_ms: f64,
    /// Full replace of the three tables with K present, ms (median).
    pub replace_ms: f64,
    /// One instance added, ms (median).
    pub add_ms: f64,
    /// One instance added, ms (p90).
    pub add_p90_ms: f64,
    /// One instance removed, ms (median).
    pub remove_ms: f64,
    /// One instance removed, ms (p90).
    pub remove_p90_ms: f64,
    /// Listing + census of the drift audit, ms (median).
    pub audit_ms: f64,
    /// Tap guard attached to one new tap with K guarded taps present, ms (median).
    pub guard_add_ms: f64,
    /// Tap guard attached to one new tap, ms (p90).
    pub guard_add_p90_ms: f64,
    /// Tap guard entries of one tap forgotten, ms (median).
    pub guard_remove_ms: f64,
}

fn instance(i: usize) -> InstanceSpec {
    let id = format!("bench-{i}");
    let n = u32::try_from(i).unwrap_or(0) + 2;
    InstanceSpec {
        allocation_id: format!("alloc-{i}"),
        policy: match i % 3 {
            0 => NetworkPolicy::Public,
            1 => NetworkPolicy::Private,
            _ => NetworkPolicy::None,
        },
        sandbox: i.is_multiple_of(2),
        nics: vec![NicSpec {
            network: Some("br0".parse().expect("constant bridge name")),
            mac: MacAddr::for_instance(&id),
            addresses: vec![ipnet::IpNet::V4(
                ipnet::Ipv4Net::new(std::net::Ipv4Addr::from(0x0a00_0000 + n), 16)
                    .expect("prefix 16"),
            )],
            gateway: Some(std::net::IpAddr::from([10, 0, 0, 1])),
            nameservers: vec![],
        }],
        id,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let len = v.len() as f64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let i = ((len - 1.0) * q).round() as usize;
    v[i.min(v.len() - 1)]
}

struct NsGuard(String);

impl Drop for NsGuard {
    fn drop(&mut self) {
        let _ = vmnet_kernel::netns::delete(&self.0);
    }
}

fn bench_one(k: usize, reps: usize) -> Result<NftBenchRow, Error> {
    let ns = format!("vmbn{}k{k}", std::process::id());
    vmnet_kernel::netns::create(&ns)
        .map_err(|e| Error::unavailable(format!("bench netns {ns}: {e}")))?;
    let _guard = NsGuard(ns.clone());
    let nft = LibNft::in_netns(&ns).map_err(|e| Error::unavailable(format!("libnftables: {e}")))?;
    let host = HostAddrs {
        own: vec![std::net::IpAddr::from([10, 0, 0, 1])],
        gateways: vec![],
    };
    let node = NodeSpec {
        instances: (0..k).map(instance).collect(),
    };
    let fw = plan(&node, &host)?;
    let full = render_full(&fw).to_string();
    let fail = |e: vmnet_kernel::pool::firewall::FirewallError| e.to_error();

    let t = Instant::now();
    nft.apply(&full).map_err(fail)?;
    let scratch = t.elapsed();
    let mut replace = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        nft.apply(&full).map_err(fail)?;
        replace.push(ms(t.elapsed()));
    }

    let mut pf = PoolFirewall::new(nft);
    pf.replace(fw).map_err(fail)?;
    let rules: usize = pf.observe().map_err(fail)?.rule_counts().values().sum();
    let extra = instance(k + 1);
    let (mut add, mut remove) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        pf.add_instance(&extra).map_err(fail)?;
        add.push(ms(t.elapsed()));
        let t = Instant::now();
        pf.remove_instance(&extra.id).map_err(fail)?;
        remove.push(ms(t.elapsed()));
    }
    let mut audit = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let r = pf.audit().map_err(fail)?;
        audit.push(ms(t.elapsed()));
        if r.repaired {
            return Err(Error::internal(format!(
                "bench: unexpected drift {:?}",
                r.drift
            )));
        }
    }
    let (mut guard_add, mut guard_remove) = guard_costs(&ns, k, reps)?;
    Ok(NftBenchRow {
        k,
        rules,
        full_bytes: full.len(),
        scratch_ms: ms(scratch),
        replace_ms: quantile(&mut replace, 0.5),
        add_ms: quantile(&mut add.clone(), 0.5),
        add_p90_ms: quantile(&mut add, 0.9),
        remove_ms: quantile(&mut remove.clone(), 0.5),
        remove_p90_ms: quantile(&mut remove, 0.9),
        audit_ms: quantile(&mut audit, 0.5),
        guard_add_ms: quantile(&mut guard_add.clone(), 0.5),
        guard_add_p90_ms: quantile(&mut guard_add, 0.9),
        guard_remove_ms: quantile(&mut guard_remove, 0.5),
    })
}

/// K guarded taps on bridge `br0` in `ns`, then `reps` rounds of: a new tap, the guard attached
/// (timed), forgotten (timed), the tap deleted. Returns the attach and forget times, ms.
fn guard_costs(ns: &str, k: usize, reps: usize) -> Result<(Vec<f64>, Vec<f64>), Error> {
    use vmnet_kernel::pool::guard::TapGuard;
    use vmnet_kernel::pool::tap::{TapOwner, Taps};
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        Error::unavailable(format!("bench guard: {what}: {e}"))
    };
    let rt = tokio::runtime::Handle::current();
    let handle = rt
        .block_on(async { vmnet_kernel::netns::netlink_in(ns) })
        .map_err(|e| unavailable("netlink", &e))?;
    let br: vmnet_model::nic::IfName = "br0".parse()?;
    rt.block_on(
        handle
            .link()
            .add(rtnetlink::LinkBridge::new(br.as_str()).up().build())
            .execute(),
    )
    .map_err(|e| unavailable("bridge", &e))?;
    let taps = Taps::new(ns, handle);
    let guard = TapGuard::load(Some(ns)).map_err(|e| unavailable("load", &e))?;
    let owner = TapOwner::default();
    let entry = |i: usize| -> Result<vmnet_plan::pool::nft::TapEntry, Error> {
        let inst = instance(i);
        vmnet_plan::pool::nft::tap_entries(&inst)?
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("bench instance without a NIC"))
    };
    for i in 0..k {
        let e = entry(i)?;
        rt.block_on(taps.ensure(&e.tap, &br, e.mac, owner))
            .map_err(|err| unavailable("tap", &err))?;
        guard
            .attach(&e)
            .map_err(|err| unavailable("attach", &err))?;
    }
    let e = entry(k + 1)?;
    let (mut add, mut remove) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        rt.block_on(taps.ensure(&e.tap, &br, e.mac, owner))
            .map_err(|err| unavailable("tap", &err))?;
        let t = Instant::now();
        guard
            .attach(&e)
            .map_err(|err| unavailable("attach", &err))?;
        add.push(ms(t.elapsed()));
        let t = Instant::now();
        guard
            .forget(&e.tap)
            .map_err(|err| unavailable("forget", &err))?;
        remove.push(ms(t.elapsed()));
        rt.block_on(taps.delete(&e.tap))
            .map_err(|err| unavailable("tap delete", &err))?;
    }
    Ok((add, remove))
}

/// Runs the command.
///
/// # Errors
/// `UNAVAILABLE` when a namespace or libnftables cannot be used (needs root and
/// `libnftables.so.1`).
pub async fn run(g: &Global, args: NftBenchArgs) -> Result<(), Error> {
    let reps = args.reps.max(1);
    let sizes = args.sizes.clone();
    let rows = tokio::task::spawn_blocking(move || {
        sizes
            .iter()
            .map(|k| bench_one(*k, reps))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| Error::internal(format!("bench task: {e}")))??;
    if g.output == Output::Json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::internal(e.to_string()))?
        );
        return Ok(());
    }
    println!(
        "{:>6} {:>6} {:>10} {:>11} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>12} {:>10} {:>12}",
        "NICs",
        "rules",
        "JSON",
        "scratch ms",
        "replace ms",
        "add ms",
        "add p90",
        "remove ms",
        "remove p90",
        "audit ms",
        "guard add ms",
        "guard p90",
        "guard rm ms"
    );
    for r in &rows {
        println!(
            "{:>6} {:>6} {:>10} {:>11.2} {:>11.2} {:>9.3} {:>9.3} {:>10.3} {:>10.3} {:>9.2} {:>12.3} {:>10.3} {:>12.3}",
            r.k,
            r.rules,
            r.full_bytes,
            r.scratch_ms,
            r.replace_ms,
            r.add_ms,
            r.add_p90_ms,
            r.remove_ms,
            r.remove_p90_ms,
            r.audit_ms,
            r.guard_add_ms,
            r.guard_add_p90_ms,
            r.guard_remove_ms
        );
    }
    println!(
        "(one libnftables context in a throwaway namespace; add/remove: one element batch each, {reps} rounds;\n guard: K guarded taps on a bridge, then a new tap's guard attach and forget, {reps} rounds)"
    );
    Ok(())
}
