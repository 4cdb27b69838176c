//! The owned tables and drift with real packets: another process's `nft flush ruleset` leaves
//! the tables filtering (a spoofed frame right after it is still dropped) and its edits are
//! refused; when the owning context goes the tables go with it and only the locked bridge ports
//! filter until they are loaded again (the documented gap); the audit still finds and repairs
//! drift; a tap taken off its bridge is dropped by the backstop tables; stopping instances
//! leaves no tap and no set element behind.

mod pool_support;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use pool_support::{Lab, marker, ping_ok};
use vmnet_kernel::pool::firewall::PoolFirewall;
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_kernel::pool::probe::{Capture, send_frame, udp4_frame};
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_testkit::netns as tk;

const SHORT: Duration = Duration::from_millis(600);

fn nft(lab: &Lab, args: &[&str]) {
    let out = tk::exec(&lab.host, "nft", args, Duration::from_secs(10)).unwrap();
    assert!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `nft args` from another process must fail with EPERM (the tables are owned).
fn nft_refused(lab: &Lab, args: &[&str]) {
    let out = tk::exec(&lab.host, "nft", args, Duration::from_secs(10)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Operation not permitted"),
        "nft {args:?} from another process must be refused (EPERM): {err}"
    );
}

fn tables(lab: &Lab) -> String {
    let out = tk::exec(
        &lab.host,
        "nft",
        &["list", "tables"],
        Duration::from_secs(10),
    )
    .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn all_three(lab: &Lab) -> bool {
    let t = tables(lab);
    ["bridge bcd_instances", "inet bcd_taps", "arp bcd_taps"]
        .iter()
        .all(|n| t.contains(&format!("table {n}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_flush_and_edits_leave_the_owned_tables_filtering() {
    let mut lab = Lab::new("pd").await;
    let a = lab
        .add("inst-a", "10.0.0.2", NetworkPolicy::Public, false)
        .await;
    let b = lab
        .add("inst-b", "10.0.0.3", NetworkPolicy::Public, false)
        .await;
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
    let honest = |tag: &str| {
        let m = marker(tag);
        send_frame(
            &ga.ns,
            "eth0",
            &udp4_frame(gb.mac, ga.mac, ga.ip4, gb.ip4, (1, 2), &m),
        )
        .unwrap();
        cap.saw(&m, SHORT)
    };
    assert!(honest("honest-before"), "control: an honest frame arrives");
    assert!(
        !spoof_ip("ip-before"),
        "IPv4 spoof drops while the tables are loaded"
    );

    // Another process flushes the ruleset: nft succeeds, the owned tables stay, and a spoofed
    // frame sent right after (no audit in between) is still dropped.
    nft(&lab, &["flush", "ruleset"]);
    assert!(
        !spoof_ip("ip-after-flush"),
        "no gap after an external flush"
    );
    assert!(!spoof_mac("mac-after-flush"));
    assert!(all_three(&lab), "{}", tables(&lab));
    assert!(honest("honest-after-flush"));
    let r = lab.pool.firewall.audit().unwrap();
    assert!(r.drift.is_empty() && !r.repaired, "nothing drifted: {r:?}");

    // Edits by another process are refused and change nothing.
    nft_refused(&lab, &["delete", "table", "bridge", "bcd_instances"]);
    nft_refused(&lab, &["flush", "table", "bridge", "bcd_instances"]);
    nft_refused(
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
    nft_refused(&lab, &["add", "chain", "inet", "bcd_taps", "sneaky"]);
    let elem = format!("{{ \"{}\" . {} }}", ga.tap, ga.ip4);
    nft_refused(
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
    nft_refused(&lab, &["delete", "table", "arp", "bcd_taps"]);
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
    assert!(!spoof_ip("ip-after-edits"));

    // The audit still repairs drift the owner's socket made (a missing backstop table).
    lab.pool
        .firewall
        .exec()
        .run_text("delete table inet bcd_taps")
        .unwrap();
    let r = lab.pool.firewall.audit().unwrap();
    assert!(
        r.repaired
            && r.drift
                .iter()
                .any(|d| d.contains("inet bcd_taps is missing")),
        "{r:?}"
    );
    assert!(all_three(&lab));
    assert_eq!(lab.pool.firewall.status().drift_repairs, 1);

    // The owner goes (its context is dropped, as when the helper dies): the kernel deletes the
    // tables. The gap: the bridge's locked port still drops a foreign source MAC; the IP checks
    // are gone until a new owner loads them (documented in vmnet_kernel::pool::firewall).
    let desired = lab.pool.firewall.desired().clone();
    let fresh = LibNft::in_netns(&lab.host).unwrap();
    drop(std::mem::replace(
        &mut lab.pool.firewall,
        PoolFirewall::new(fresh),
    ));
    assert!(!tables(&lab).contains("bcd_"), "{}", tables(&lab));
    assert!(
        !spoof_mac("mac-in-gap"),
        "locked port drops a foreign MAC even with no tables"
    );
    assert!(
        spoof_ip("ip-in-gap"),
        "without the tables an IPv4 spoof passes (the documented gap)"
    );
    lab.pool.firewall.replace(desired).unwrap();
    assert!(all_three(&lab));
    assert!(!spoof_ip("ip-after-reload"), "the new owner filters again");
    nft(&lab, &["flush", "ruleset"]);
    assert!(!spoof_ip("ip-after-second-flush"));
    assert!(
        ping_ok(&ga.ns, IpAddr::V4(gb.ip4)),
        "traffic works throughout"
    );
    drop(cap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tap_off_its_bridge_is_dropped_by_the_backstop() {
    let mut lab = Lab::new("pe").await;
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
    // Only their owner can delete them.
    nft_refused(&lab, &["delete", "table", "inet", "bcd_taps"]);
    lab.pool
        .firewall
        .exec()
        .run_text(
            "delete table inet bcd_taps
delete table arp bcd_taps",
        )
        .unwrap();
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
    let again = lab.pool.start_instance(&inst_a).await;
    assert!(again.is_err(), "starting twice is a conflict");
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
    assert!(listing.contains("\"inet\", \"name\": \"bcd_taps\"") || listing.contains("bcd_taps"));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    lab.guests[b].relay.take();
    lab.pool.stop_instance(&inst_b).await.unwrap();
    assert!(!lab.link_exists(&tap_b));
    let listing = lab.nft_list();
    assert!(!listing.contains(&tap_b));
    assert!(
        !listing.contains("bcd_taps"),
        "no instance NIC: both backstop tables are gone"
    );
    assert!(listing.contains("bcd_instances"));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
}
