//! `vmnet-lab bench nft`: pool-mode ruleset apply and per-instance add/remove cost.
//!
//! For each K (default 10, 100, 1000 NICs) in its own throwaway namespace: the three bcd tables
//! applied from scratch, a full replace of all three with K present, and one instance added and
//! removed as an element batch with K present (median and p90 of `--reps` rounds), all through
//! one libnftables context held in the namespace, as the root helper holds it. Also the
//! read-back (listing + content comparison) the drift audit pays. Then the tap guard's share of an instance
//! add/remove with K guarded taps on a bridge in the same namespace: attaching it to a new tap
//! (map writes, clsact qdisc, two `cls_bpf` filters) and forgetting it. Prints a table (or JSON
//! with `--output json`).
//!
//! # Bounds, namespaces and signals
//! Each size is 1..=20000 NICs and `--reps` is 1..=10000 (other values are argument errors).
//! The namespaces are named `vmbn<pid>k<K>` (`<pid>`: the bench's process) and deleted when
//! each size is done. At start, the bench deletes `vmbn<pid>k<K>` namespaces whose `<pid>` is
//! no running process (none, or a zombie): leftovers of a bench that was killed; those of a
//! running bench, and every other name, are left alone. SIGINT or SIGTERM while it runs stops
//! it at the next round (a round is one apply, one add/remove or one tap; a set-up step such
//! as the first apply of K NICs finishes first): the namespace is deleted and the command
//! fails with `UNAVAILABLE` `bench nft: stopped by SIGINT/SIGTERM`. A SIGKILL leaves the
//! namespace to the next run's clean-up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmnet_agent::api::error::from_firewall;
use vmnet_kernel::pool::firewall::{NftExec, PoolFirewall};
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_model::Error;
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec, NodeSpec};
use vmnet_plan::pool::nft::{HostAddrs, plan, render_full};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct NftBenchArgs {
    /// Numbers of instance NICs to measure, comma separated, each 1..=20000.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10,100,1000",
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_SIZE)
    )]
    pub sizes: Vec<usize>,
    /// Rounds of add/remove per size (median and p90 reported), 1..=10000.
    #[arg(
        long,
        default_value_t = 50,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_REPS)
    )]
    pub reps: usize,
}

/// The largest `--sizes` value (NICs per namespace).
pub const MAX_SIZE: u64 = 20_000;
/// The largest `--reps` value.
pub const MAX_REPS: u64 = 10_000;

/// The first part of the bench's namespace names, `vmbn<pid>k<K>`.
const NS_PREFIX: &str = "vmbn";

/// Set by the signal watcher of [`run`] on SIGINT or SIGTERM; the bench checks it between
/// rounds and stops, so its namespace guards run.
static STOP: AtomicBool = AtomicBool::new(false);

/// The namespace of size `k` of the bench in process `pid`.
fn ns_name(pid: u32, k: usize) -> String {
    format!("{NS_PREFIX}{pid}k{k}")
}

/// The process id in a bench namespace name `vmbn<pid>k<K>` (both decimal), or `None` for any
/// other name.
fn ns_pid(name: &str) -> Option<u32> {
    let (pid, k) = name.strip_prefix(NS_PREFIX)?.split_once('k')?;
    let decimal = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if decimal(pid) && decimal(k) {
        pid.parse().ok()
    } else {
        None
    }
}

/// Of `names`, the bench namespaces whose process is not `alive`.
fn stale(names: &[String], alive: impl Fn(u32) -> bool) -> Vec<String> {
    names
        .iter()
        .filter(|n| ns_pid(n).is_some_and(|pid| !alive(pid)))
        .cloned()
        .collect()
}

/// Deletes the namespaces of benches that no longer run (see the module docs) and returns
/// their names.
///
/// # Errors
/// `UNAVAILABLE` when `/run/netns` cannot be read or a namespace cannot be deleted.
fn remove_stale_namespaces() -> Result<Vec<String>, Error> {
    let names = vmnet_kernel::netns::list(NS_PREFIX)
        .map_err(|e| Error::unavailable(format!("bench netns: listing {NS_PREFIX}*: {e}")))?;
    let own = std::process::id();
    let gone = stale(&names, |pid| {
        pid == own || vmnet_sandbox::sandbox::process_runs(pid)
    });
    for n in &gone {
        vmnet_kernel::netns::delete(n)
            .map_err(|e| Error::unavailable(format!("bench netns {n}: deleting: {e}")))?;
    }
    Ok(gone)
}

/// `UNAVAILABLE` once `stop` is set.
fn check(stop: &AtomicBool) -> Result<(), Error> {
    if stop.load(Ordering::Relaxed) {
        Err(Error::unavailable("bench nft: stopped by SIGINT/SIGTERM"))
    } else {
        Ok(())
    }
}

/// Sets [`STOP`] on the first SIGINT or SIGTERM (the handlers stay installed until the
/// process ends, so later ones are ignored too).
///
/// # Errors
/// `INTERNAL` when a handler cannot be installed.
fn watch_signals() -> Result<tokio::task::JoinHandle<()>, Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let install = |kind: SignalKind| {
        signal(kind).map_err(|e| Error::internal(format!("bench nft: signal handler: {e}")))
    };
    let mut int = install(SignalKind::interrupt())?;
    let mut term = install(SignalKind::terminate())?;
    Ok(tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        STOP.store(true, Ordering::Relaxed);
    }))
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
    /// Listing + content comparison of the drift audit, ms (median).
    pub audit_ms: f64,
    /// The listing alone (`list ruleset` and its JSON parsed), ms (median): the part of
    /// `audit_ms` that nft costs; the rest is the comparison.
    pub list_ms: f64,
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
            gateway6: None,
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

/// Measures size `k` in its own namespace; stops with `UNAVAILABLE` between rounds once
/// `stop` is set (the namespace is deleted either way).
fn bench_one(k: usize, reps: usize, stop: &AtomicBool) -> Result<NftBenchRow, Error> {
    check(stop)?;
    let ns = ns_name(std::process::id(), k);
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
    let fail = |e: vmnet_kernel::pool::firewall::FirewallError| from_firewall(&e);

    let t = Instant::now();
    nft.apply(&full).map_err(fail)?;
    let scratch = t.elapsed();
    let mut replace = Vec::new();
    for _ in 0..5 {
        check(stop)?;
        let t = Instant::now();
        nft.apply(&full).map_err(fail)?;
        replace.push(ms(t.elapsed()));
    }

    check(stop)?;
    let mut pf = PoolFirewall::new(nft);
    pf.replace(fw).map_err(fail)?;
    let rules: usize = pf.observe().map_err(fail)?.rule_counts().values().sum();
    let extra = instance(k + 1);
    let (mut add, mut remove) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        check(stop)?;
        let t = Instant::now();
        pf.add_instance(&extra).map_err(fail)?;
        add.push(ms(t.elapsed()));
        let t = Instant::now();
        pf.remove_instance(&extra.id).map_err(fail)?;
        remove.push(ms(t.elapsed()));
    }
    let mut audit = Vec::new();
    let mut list = Vec::new();
    for _ in 0..5 {
        check(stop)?;
        let t = Instant::now();
        let listed = pf.exec().list().map_err(fail)?;
        let _: serde_json::Value = serde_json::from_str(&listed)
            .map_err(|e| Error::internal(format!("bench: listing is not JSON: {e}")))?;
        list.push(ms(t.elapsed()));
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
    let (mut guard_add, mut guard_remove) = guard_costs(&ns, k, reps, stop)?;
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
        list_ms: quantile(&mut list, 0.5),
        guard_add_ms: quantile(&mut guard_add.clone(), 0.5),
        guard_add_p90_ms: quantile(&mut guard_add, 0.9),
        guard_remove_ms: quantile(&mut guard_remove, 0.5),
    })
}

/// K guarded taps on bridge `br0` in `ns`, then `reps` rounds of: a new tap, the guard attached
/// (timed), forgotten (timed), the tap deleted. Returns the attach and forget times, ms.
/// Stops with `UNAVAILABLE` between taps and rounds once `stop` is set.
fn guard_costs(
    ns: &str,
    k: usize,
    reps: usize,
    stop: &AtomicBool,
) -> Result<(Vec<f64>, Vec<f64>), Error> {
    use vmnet_kernel::pool::guard::TapGuard;
    use vmnet_kernel::pool::tap::Taps;
    use vmnet_kernel::tap::TapOwner;
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
        check(stop)?;
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
        check(stop)?;
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
/// Deletes stale bench namespaces first (named on stderr), and stops cleanly on SIGINT or
/// SIGTERM (see the module docs).
///
/// # Errors
/// `UNAVAILABLE` when a namespace or libnftables cannot be used (needs root and
/// `libnftables.so.1`), and `bench nft: stopped by SIGINT/SIGTERM` after a signal.
pub async fn run(json: bool, args: NftBenchArgs) -> Result<(), Error> {
    let reps = args.reps;
    let sizes = args.sizes.clone();
    for n in remove_stale_namespaces()? {
        eprintln!("bench nft: removed namespace {n} left by a bench that no longer runs");
    }
    let signals = watch_signals()?;
    let rows = tokio::task::spawn_blocking(move || {
        sizes
            .iter()
            .map(|k| bench_one(*k, reps, &STOP))
            .collect::<Result<Vec<_>, _>>()
    })
    .await;
    signals.abort();
    let rows = rows.map_err(|e| Error::internal(format!("bench task: {e}")))??;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::internal(e.to_string()))?
        );
        return Ok(());
    }
    println!(
        "{:>6} {:>6} {:>10} {:>11} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>8} {:>12} {:>10} {:>12}",
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
        "list ms",
        "guard add ms",
        "guard p90",
        "guard rm ms"
    );
    for r in &rows {
        println!(
            "{:>6} {:>6} {:>10} {:>11.2} {:>11.2} {:>9.3} {:>9.3} {:>10.3} {:>10.3} {:>9.2} {:>8.2} {:>12.3} {:>10.3} {:>12.3}",
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
            r.list_ms,
            r.guard_add_ms,
            r.guard_add_p90_ms,
            r.guard_remove_ms
        );
    }
    println!(
        "(one libnftables context in a throwaway namespace; add/remove: one element batch each, {reps} rounds;\n audit: listing + content comparison, list: the listing alone;\n guard: K guarded taps on a bridge, then a new tap's guard attach and forget, {reps} rounds)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{
        AtomicBool, NftBenchArgs, Ordering, bench_one, ns_name, ns_pid, remove_stale_namespaces,
        stale,
    };
    use clap::Parser;
    use std::sync::Arc;
    use vmnet_kernel::netns;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: NftBenchArgs,
    }

    fn parse(args: &[&str]) -> Result<NftBenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("nft").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn sizes_and_reps_are_bounded() {
        let a = parse(&[]).unwrap();
        assert_eq!((a.sizes, a.reps), (vec![10, 100, 1000], 50));
        let a = parse(&["--sizes", "1,20000", "--reps", "10000"]).unwrap();
        assert_eq!((a.sizes, a.reps), (vec![1, 20000], 10000));
        assert_eq!(parse(&["--reps", "1"]).unwrap().reps, 1);
        for bad in [
            &["--reps", "0"][..],
            &["--reps", "10001"],
            &["--reps=-1"],
            &["--sizes", "0"],
            &["--sizes", "10,20001"],
            &["--sizes", "10,,100"],
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad:?}");
        }
        let e = parse(&["--reps", "0"]).unwrap_err().to_string();
        assert!(e.contains("0 is not in 1..=10000"), "{e}");
    }

    #[test]
    fn stale_names_are_bench_namespaces_of_processes_that_are_gone() {
        assert_eq!(ns_name(42, 1000), "vmbn42k1000");
        assert_eq!(ns_pid("vmbn42k1000"), Some(42));
        for other in [
            "vmbn42k",
            "vmbnk10",
            "vmbn42",
            "vmbn+42k10",
            "vmbn42k10x",
            "vmbnxk1",
            "vmb42k1",
        ] {
            assert_eq!(ns_pid(other), None, "{other}");
        }
        let names: Vec<String> = ["vmbn1k10", "vmbn2k10", "vmbn2k100", "vmbn3kx", "other"]
            .map(String::from)
            .to_vec();
        assert_eq!(stale(&names, |pid| pid == 1), ["vmbn2k10", "vmbn2k100"]);
        assert!(stale(&names, |_| true).is_empty());
    }

    /// Deletes the named namespace when dropped.
    struct Cleanup(Vec<String>);

    impl Drop for Cleanup {
        fn drop(&mut self) {
            for n in &self.0 {
                let _ = netns::delete(n);
            }
        }
    }

    #[test]
    #[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
    fn stale_namespaces_of_dead_benches_are_removed_and_no_others() {
        vmnet_testkit::require_root();
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        child.wait().expect("wait true");
        let dead = child.id();
        let own = std::process::id();
        let (gone, mine, other) = (
            ns_name(dead, 3),
            ns_name(own, 3),
            format!("vmbn{dead}kx{own}"),
        );
        let _cleanup = Cleanup(vec![gone.clone(), mine.clone(), other.clone()]);
        for n in [&gone, &mine, &other] {
            netns::create(n).expect("create netns");
        }
        let removed = remove_stale_namespaces().expect("clean-up");
        assert!(removed.contains(&gone), "{removed:?}");
        assert!(!removed.contains(&mine) && !removed.contains(&other));
        assert!(!netns::exists(&gone));
        assert!(netns::exists(&mine) && netns::exists(&other));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
    async fn a_stop_ends_the_bench_between_rounds_and_deletes_its_namespace() {
        vmnet_testkit::require_root();
        let k = 1999;
        let ns = ns_name(std::process::id(), k);
        let _cleanup = Cleanup(vec![ns.clone()]);
        let stop = Arc::new(AtomicBool::new(false));
        let setter = {
            let (stop, ns) = (Arc::clone(&stop), ns.clone());
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !netns::exists(&ns) {
                    assert!(std::time::Instant::now() < deadline, "{ns} never appeared");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
                stop.store(true, Ordering::Relaxed);
                std::time::Instant::now()
            })
        };
        let flag = Arc::clone(&stop);
        let result = tokio::task::spawn_blocking(move || bench_one(k, 10_000, &flag))
            .await
            .expect("join");
        let stopped_at = setter.join().expect("setter");
        let e = result.expect_err("the bench must stop");
        assert_eq!(e.code, vmnet_model::ErrorCode::Unavailable);
        assert_eq!(e.message, "bench nft: stopped by SIGINT/SIGTERM");
        assert!(
            stopped_at.elapsed() < std::time::Duration::from_secs(5),
            "stopped within a round"
        );
        assert!(!netns::exists(&ns), "{ns} is deleted");
    }
}
