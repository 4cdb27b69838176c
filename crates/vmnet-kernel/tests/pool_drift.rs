//! Drift and the backstop with real packets: a flushed ruleset is found and repaired (within
//! one 5 s audit period), what guests can do in the gap (nothing unfiltered), a tap taken off its bridge is dropped
//! by the backstop tables, edits and missing elements are found, and stopping instances leaves
//! no tap and no set element behind.

mod pool_support;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pool_support::{Lab, marker, ping_ok};
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_testkit::netns as tk;
use vmnet_testkit::probe::{Capture, send_frame, udp4_frame};

const SHORT: Duration = Duration::from_millis(600);

fn nft(lab: &Lab, args: &[&str]) {
    let out = tk::exec(&lab.host, "nft", args, Duration::from_secs(10)).unwrap();
    assert!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn flush_is_repaired_and_the_gap_stays_filtered() {
    let mut lab = Lab::new("pd").await;
    let (a, b) = lab.add_public_pair().await;
    assert!(
        lab.pool.firewall.audit().unwrap().drift.is_empty(),
        "no drift right after start"
    );
    let (ga, gb) = (&lab.guests[a], &lab.guests[b]);
    let cap = Capture::start(&gb.ns, "eth0").unwrap();
    let foreign_mac = MacAddr([0x02, 0xde, 0xad, 0, 0, 9]);
    let spoof_ip = |tag: &str| {
        let m = marker(tag);
        send_frame(
            &ga.ns,
            "eth0",
            &udp4_frame(
                gb.mac,
                ga.mac,
                Ipv4Addr::new(10, 0, 0, 6),
                gb.ip4,
                (1, 2),
                &m,
            ),
        )
        .unwrap();
        cap.saw(&m, SHORT)
    };
    let spoof_mac = |tag: &str| {
        let m = marker(tag);
        send_frame(
            &ga.ns,
            "eth0",
            &udp4_frame(gb.mac, foreign_mac, ga.ip4, gb.ip4, (1, 2), &m),
        )
        .unwrap();
        cap.saw(&m, SHORT)
    };
    assert!(
        !spoof_ip("ip-before"),
        "IPv4 spoof drops while the tables are loaded"
    );

    nft(&lab, &["flush", "ruleset"]);
    // The gap: the bridge's locked port drops a foreign source MAC and the tap guard drops the
    // rest (each check with the guard alone: tests/pool_guard.rs).
    assert!(
        !spoof_mac("mac-in-gap"),
        "a foreign MAC drops even with no ruleset"
    );
    assert!(
        !spoof_ip("ip-in-gap"),
        "an IPv4 spoof drops even with no ruleset (tap guard)"
    );

    let report = lab.pool.firewall.audit().unwrap();
    assert!(report.repaired, "{report:?}");
    assert!(
        report.drift.iter().any(|d| d.contains("missing")),
        "{report:?}"
    );
    assert_eq!(lab.pool.firewall.status().drift_repairs, 1);
    assert!(
        !spoof_ip("ip-after"),
        "IPv4 spoof drops again after the repair"
    );
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    // An added rule and a deleted element are drift too.
    nft(
        &lab,
        &[
            "add",
            "rule",
            "bridge",
            "bcd_instances",
            "from_tap",
            "accept",
        ],
    );
    assert!(
        lab.pool.firewall.audit().unwrap().repaired,
        "an added rule is drift"
    );
    nft(&lab, &["add", "chain", "inet", "bcd_taps", "sneaky"]);
    assert!(
        lab.pool.firewall.audit().unwrap().repaired,
        "an added chain is drift"
    );
    let elem = format!("{{ \"{}\" . {} }}", ga.tap, ga.ip4);
    nft(
        &lab,
        &[
            "delete",
            "element",
            "bridge",
            "bcd_instances",
            "tap_ip4",
            &elem,
        ],
    );
    assert!(
        lab.pool.firewall.audit().unwrap().repaired,
        "a missing element is drift"
    );
    assert!(
        ping_ok(&ga.ns, IpAddr::V4(gb.ip4)),
        "traffic works after repairs"
    );
    assert_eq!(lab.pool.firewall.status().drift_repairs, 4);
    drop(cap);

    // The periodic audit (5 s, as the agent runs it) repairs a flush within one period.
    let stop = AtomicBool::new(false);
    let host = lab.host.clone();
    let fw = &mut lab.pool.firewall;
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(5) && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                if !stop.load(Ordering::Relaxed) {
                    fw.audit().unwrap();
                }
            }
        });
        std::thread::sleep(Duration::from_millis(1500));
        let out = tk::exec(&host, "nft", &["flush", "ruleset"], Duration::from_secs(10)).unwrap();
        assert!(out.status.success());
        let flushed = Instant::now();
        let repaired = loop {
            let out = tk::exec(&host, "nft", &["list", "tables"], Duration::from_secs(10)).unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if text.contains("bcd_instances")
                && text.contains("inet bcd_taps")
                && text.contains("arp bcd_taps")
            {
                break flushed.elapsed();
            }
            assert!(
                flushed.elapsed() < Duration::from_secs(8),
                "not repaired after 8 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        stop.store(true, Ordering::Relaxed);
        assert!(
            repaired <= Duration::from_millis(5200),
            "repaired after {repaired:?}"
        );
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn tap_off_its_bridge_is_dropped_by_the_backstop() {
    let mut lab = Lab::nft_only("pe").await;
    let b = lab
        .add("inst-b", "10.0.0.3", NetworkPolicy::Public, false)
        .await;
    let gb = &lab.guests[b];
    tk::ip(&lab.host, &["link", "set", &gb.tap, "nomaster"]).unwrap();
    tk::ip(&lab.host, &["addr", "add", "10.9.9.1/24", "dev", &gb.tap]).unwrap();
    tk::ip(&gb.ns, &["addr", "add", "10.9.9.2/24", "dev", "eth0"]).unwrap();
    let target = IpAddr::V4(Ipv4Addr::new(10, 9, 9, 1));
    assert!(
        !ping_ok(&gb.ns, target),
        "a tap off its bridge reaches nothing (backstop)"
    );
    // Control: without the backstop tables the same ping works; the audit puts them back.
    nft(&lab, &["delete", "table", "inet", "bcd_taps"]);
    nft(&lab, &["delete", "table", "arp", "bcd_taps"]);
    assert!(
        ping_ok(&gb.ns, target),
        "control: without the backstop the ping passes"
    );
    let r = lab.pool.firewall.audit().unwrap();
    assert!(
        r.drift
            .iter()
            .any(|d| d.contains("inet bcd_taps is missing")),
        "{r:?}"
    );
    tk::ip(&gb.ns, &["neigh", "flush", "dev", "eth0"]).unwrap();
    assert!(!ping_ok(&gb.ns, target), "backstop restored by the audit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn stop_leaves_no_tap_and_no_element_and_reboot_reuses_the_tap() {
    let mut lab = Lab::new("pf").await;
    let a = lab
        .add("inst-a", "10.0.0.2", NetworkPolicy::Private, true)
        .await;
    let b = lab
        .add("inst-b", "10.0.0.3", NetworkPolicy::None, false)
        .await;
    let (tap_a, tap_b) = (lab.guests[a].tap.clone(), lab.guests[b].tap.clone());
    let (inst_a, inst_b) = (lab.guests[a].inst.clone(), lab.guests[b].inst.clone());
    assert!(lab.nft_list().contains(&tap_a));

    // A guest reboot: the VMM closes and reopens the same persistent tap.
    let relay = lab.guests[a].relay.take();
    drop(relay);
    assert!(
        lab.link_exists(&tap_a),
        "the persistent tap outlives its opener"
    );
    // Starting it again (a restarted agent) reuses the tap and changes no element.
    let again = lab.pool.start_instance(&inst_a).await.unwrap();
    assert_eq!(again, [vmnet_kernel::pool::tap::TapAction::Reused]);
    let reopened = vmnet_testkit::tap::open_existing_tap(&lab.host, &tap_a);
    assert!(reopened.is_ok(), "the same tap reopens after a reboot");
    drop(reopened);

    lab.pool.stop_instance(&inst_a).await.unwrap();
    assert!(!lab.link_exists(&tap_a), "no tap after stop");
    let listing = lab.nft_list();
    assert!(
        !listing.contains(&tap_a),
        "no set element of a stopped instance"
    );
    assert!(listing.contains(&tap_b));
    let guard = lab.pool.taps.guard.clone().unwrap();
    assert_eq!(
        guard
            .taps()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        std::slice::from_ref(&tap_b),
        "no guard entry of a stopped instance"
    );
    assert!(listing.contains("\"inet\", \"name\": \"bcd_taps\"") || listing.contains("bcd_taps"));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    lab.guests[b].relay.take();
    lab.pool.stop_instance(&inst_b).await.unwrap();
    assert!(!lab.link_exists(&tap_b));
    assert!(guard.taps().is_empty(), "no guard entry left");
    assert_eq!(
        guard.map_sizes().unwrap(),
        (0, 0, 0),
        "the guard's kernel maps are empty"
    );
    let listing = lab.nft_list();
    assert!(!listing.contains(&tap_b));
    assert!(
        !listing.contains("bcd_taps"),
        "no instance NIC: both backstop tables are gone"
    );
    assert!(listing.contains("bcd_instances"));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
}
