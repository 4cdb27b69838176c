//! Pool mode's tables repaired on the kernel's nf_tables notifications (root required): the
//! agent runs pool mode with the real root helper inside a sandbox host (the links are the
//! fakes of `pool_fakes`), its 5-second audit slowed to an hour, and listens to the
//! notifications of that host. `nft flush ruleset`, a deleted anti-spoofing rule, a swapped
//! set element (a tap's MAC) and a base chain's policy flipped to drop are each put back by
//! the audit the notification runs, within a second, and counted by kind.

mod common;
mod pool_fakes;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use common::Harness;
use pool_fakes::{host_links, placed, tap_of};
use serde_json::Value;
use vmnet_agent::pool::helper::HelperClient;
use vmnet_agent::pool::node::{PoolConfig, PoolNode};
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_plan::ns::NsSettings;
use vmnet_testkit::nft::nft;

const REPAIRED_WITHIN: Duration = Duration::from_secs(1);

async fn notifications(h: &Harness) -> Value {
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    st["reconcile"]["notifications"].clone()
}

/// Runs `change`, then waits until a notification repaired something; returns how long that
/// took.
async fn repaired(h: &Harness, step: &str, change: impl FnOnce()) -> Duration {
    // Let the notifications of earlier changes be handled first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = notifications(h).await["repairs_total"].as_u64().unwrap();
    let start = Instant::now();
    change();
    loop {
        let n = notifications(h).await;
        if n["repairs_total"].as_u64().unwrap() > before {
            let took = start.elapsed();
            eprintln!(
                "{step}: repaired {:.1} ms after the change (agent: {} µs)",
                took.as_secs_f64() * 1000.0,
                n["last_change_to_repair_us"]
            );
            return took;
        }
        assert!(
            start.elapsed() < REPAIRED_WITHIN,
            "{step}: not repaired within {REPAIRED_WITHIN:?}: {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The rule of `bridge bcd_instances` naming `needle`, as (chain, handle).
fn bridge_rule(ns: &str, needle: &str) -> (String, String) {
    let listing = nft(ns, &["-a", "list", "table", "bridge", "bcd_instances"]).unwrap();
    let mut chain = String::new();
    for line in listing.lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("chain ") {
            chain = c.split_whitespace().next().unwrap().to_owned();
        } else if line.contains(needle)
            && let Some((_, h)) = line.rsplit_once("# handle ")
        {
            return (chain, h.trim().to_owned());
        }
    }
    panic!("no rule naming {needle}:\n{listing}");
}

/// The first element of set `set` of `bridge bcd_instances`, as nft lists it.
fn first_element(ns: &str, set: &str) -> String {
    let listing = nft(ns, &["list", "set", "bridge", "bcd_instances", set]).unwrap();
    let (_, rest) = listing
        .split_once("elements = {")
        .unwrap_or_else(|| panic!("no elements: {listing}"));
    rest.split([',', '}']).next().unwrap().trim().to_owned()
}

/// `elem` (`"tap" . 02:…:xx`) with the MAC's last octet changed.
fn swap_last_octet(elem: &str) -> String {
    let (head, last) = elem.rsplit_once(':').unwrap();
    let octet = u8::from_str_radix(last.trim(), 16).unwrap() ^ 0x5a;
    format!("{head}:{octet:02x}")
}

/// The first base chain (one with a policy) of `bridge bcd_instances`: name and policy.
fn base_chain(ns: &str) -> (String, String) {
    let listing = nft(ns, &["list", "table", "bridge", "bcd_instances"]).unwrap();
    let mut chain = String::new();
    for line in listing.lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("chain ") {
            chain = c.split_whitespace().next().unwrap().to_owned();
        } else if line.starts_with("type ")
            && let Some((_, p)) = line.split_once("; policy ")
        {
            return (chain, p.trim_end_matches(';').trim().to_owned());
        }
    }
    panic!("no base chain: {listing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn pool_tables_flushed_or_edited_are_repaired_on_their_notification() {
    vmnet_testkit::require_root();
    let sb = vmnet_testkit::Sandbox::new("pn").unwrap();
    let host = sb.host();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let mut driver = NetlinkNsDriver::new(settings.clone(), Some(host.clone())).unwrap();
    let events = driver.watch_kernel().unwrap();
    let driver: Arc<dyn NsDriver> = Arc::new(driver);
    let tmp = tempfile::tempdir().unwrap();
    let h = Harness::open_with(tmp.path(), driver, settings).await;
    placed(&h, &[("inst-a", "h1")]).await;
    let links = host_links(&["inst-a"]);
    let ns = host.clone();
    let helper = HelperClient::spawn(move || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmnet-pool-helper"));
        cmd.env("VMNET_HELPER_NETNS", &ns);
        cmd
    })
    .unwrap();
    let cfg = PoolConfig {
        host_id: "h1".into(),
        bridge: "br0".parse().unwrap(),
        seed_dir: h.dir.join("seeds"),
        seed_images: false,
    };
    // The 5-second audit slowed to an hour: only a notification can repair.
    let node = PoolNode::start(
        cfg,
        helper,
        Arc::new(links.clone()),
        h.agent.db(),
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    h.agent.set_pool(Arc::clone(&node)).unwrap();
    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let _watch = h.agent.start_watching(events);
    let tap = tap_of("inst-a");
    let tables = |ns: &str| nft(ns, &["list", "tables"]).unwrap();
    let before = nft(&host, &["list", "table", "bridge", "bcd_instances"]).unwrap();
    assert!(before.contains(&tap), "{before}");

    let mut times = Vec::new();
    times.push(
        repaired(&h, "nft flush ruleset", || {
            nft(&host, &["flush", "ruleset"]).unwrap();
        })
        .await,
    );
    let t = tables(&host);
    for table in ["bridge bcd_instances", "inet bcd_taps", "arp bcd_taps"] {
        assert!(t.contains(table), "{table} back: {t}");
    }
    // The MAC check of every tap (its MAC from the `tap_mac` set).
    let spoof = "iifname . ether saddr != @tap_mac drop";
    let (chain, handle) = bridge_rule(&host, spoof);
    times.push(
        repaired(&h, "anti-spoofing rule deleted", || {
            nft(
                &host,
                &[
                    "delete",
                    "rule",
                    "bridge",
                    "bcd_instances",
                    &chain,
                    "handle",
                    &handle,
                ],
            )
            .unwrap();
        })
        .await,
    );
    let after = nft(&host, &["list", "table", "bridge", "bcd_instances"]).unwrap();
    assert!(
        after.contains(spoof),
        "the anti-spoofing rule is back: {after}"
    );
    // A tap's MAC element swapped for another MAC (what a guest spoofing its MAC would need).
    let elem = first_element(&host, "tap_mac");
    let swapped = swap_last_octet(&elem);
    times.push(
        repaired(&h, "set element swapped", || {
            // One transaction: the delete and the add.
            let cmd = format!(
                "delete element bridge bcd_instances tap_mac {{ {elem} }}; \
                 add element bridge bcd_instances tap_mac {{ {swapped} }}"
            );
            nft(&host, &[&cmd]).unwrap();
        })
        .await,
    );
    assert_eq!(
        first_element(&host, "tap_mac"),
        elem,
        "the planned element is back"
    );
    let (chain, policy) = base_chain(&host);
    let flipped = if policy == "accept" { "drop" } else { "accept" };
    times.push(
        repaired(&h, "chain policy flipped", || {
            let spec = format!("{{ policy {flipped}; }}");
            nft(&host, &["chain", "bridge", "bcd_instances", &chain, &spec]).unwrap();
        })
        .await,
    );
    assert_eq!(
        base_chain(&host),
        (chain, policy),
        "the planned policy is back"
    );
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    let kinds = &st["reconcile"]["repairs"]["by_kind"];
    eprintln!("repairs by kind: {kinds}");
    for kind in ["nft_table", "nft_rule", "nft_set", "nft_chain"] {
        assert!(
            kinds[kind]["notification"].as_u64().unwrap() >= 1,
            "{kind}: {kinds}"
        );
    }
    // The audit that ran is the pool's own, recorded as such.
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert!(
        st["pool"]["audits"].as_u64().unwrap() >= 2,
        "{}",
        st["pool"]
    );
    let ms: Vec<String> = times
        .iter()
        .map(|t| format!("{:.1}", t.as_secs_f64() * 1000.0))
        .collect();
    eprintln!("pool change-to-repair (ms): {}", ms.join(", "));
    drop(node);
}
