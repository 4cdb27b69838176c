//! The guest guard with real packets (root required): a simulated guest joined to its VM's tap
//! (the testkit's frame relay, the real tap path) sends each kind of frame the rule covers as
//! raw frames; each is looked for where it would arrive (the fake internet, another guest, the
//! namespace's tables) and the guard's counter of its kind is read. Also: the namespace's
//! sysctls, a guard detached by hand failing closed, and drift reporting and repairing it; a new
//! agent's guard taking over a tap as an upgrade, not drift, with the traffic flowing.

mod ns_support;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use ns_support::{Env, T, v6};
use vmnet_kernel::guard::GuestGuard;
use vmnet_kernel::ns::{Change, NetlinkNsDriver};
use vmnet_model::nic::MacAddr;
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::hostile::{self, Case, Outcome};
use vmnet_testkit::probe::{
    ALL_NODES_MAC, BROADCAST, Capture, arp_reply_frame, icmp4_frame, icmp6_message, redirect,
    router_advertisement, udp4_frame, udp6_frame,
};
use vmnet_testkit::sandbox::{ECHO_V4, ECHO_V6, INET_UPLINK_IF};
use vmnet_testkit::{netns, traffic};

const GUEST_MAC: MacAddr = MacAddr([0x06, 0x00, 0xac, 0x10, 0x00, 0x02]);
const FOREIGN_MAC: MacAddr = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
const G4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
const GW4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
const PORTS: (u16, u16) = (40000, 9);

/// A sandbox whose driver runs the guest guard.
fn env() -> (Env, Arc<GuestGuard>) {
    let mut env = Env::with(|s| s.guard = true);
    let guard = Arc::new(GuestGuard::load().expect("load the guest guard"));
    env.driver = Arc::new(
        NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host()))
            .expect("driver")
            .with_guard(Arc::clone(&guard)),
    );
    (env, guard)
}

fn tap_mac(plan: &VmPlan) -> MacAddr {
    let out = netns::ip(&plan.netns, &["-j", "link", "show", "dev", &plan.tap.name]).expect("ip");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    v[0]["address"].as_str().expect("mac").parse().expect("mac")
}

fn drops(guard: &GuestGuard, plan: &VmPlan) -> BTreeMap<&'static str, u64> {
    guard
        .drops(plan.user_id)
        .expect("counters")
        .expect("registered")
}

/// Each outcome as `name: seen`, compared against the expected outcomes.
fn assert_outcomes(outcomes: &[Outcome]) {
    let bad: Vec<String> = outcomes
        .iter()
        .filter(|o| o.seen != o.expected)
        .map(|o| format!("{}: expected {}, seen {}", o.name, o.expected, o.seen))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Counter increases `after - before` for the kinds that moved.
fn moved(
    before: &BTreeMap<&'static str, u64>,
    after: &BTreeMap<&'static str, u64>,
) -> BTreeMap<&'static str, u64> {
    after
        .iter()
        .filter_map(|(k, a)| {
            let d = a - before.get(k).copied().unwrap_or(0);
            (d > 0).then_some((*k, d))
        })
        .collect()
}

fn vm(id: &str, uid: u32, extra: &str, routes: &str) -> String {
    format!(
        r#"{{"id":"{id}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid}"{extra},"network":{{"routes":[{routes}]}}}}"#
    )
}

const VIA_HOST: &str =
    r#"{"destination":"0.0.0.0/0","via":"host"},{"destination":"::/0","via":"host"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn ethernet_arp_and_ipv4_rules() {
    let (env, guard) = env();
    let plan = env.plan(&vm("a", 1, "", VIA_HOST));
    env.driver.apply(&plan).await.expect("apply");
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("a", &plan, &["::/0"], 1380);
    // The namespace learns the guest (its neighbour entry the forged ARP would replace).
    traffic::ping(guest.netns(), GW4.into(), 1, T).expect("ping the gateway");
    let mac = tap_mac(&plan);
    let inet = Capture::start(&env.sb.inet(), INET_UPLINK_IF).expect("capture");
    let (ns1, ns2) = (plan.netns.clone(), plan.netns.clone());
    let forged = move |ns: &str, ip: Ipv4Addr| {
        let out = netns::ip(ns, &["neigh", "show", &ip.to_string()]).unwrap_or_default();
        out.contains(&FOREIGN_MAC.to_string())
            .then(|| out.trim().to_owned())
    };
    let cases = vec![
        Case::honest("honest IPv4", 0, move |m| {
            udp4_frame(mac, GUEST_MAC, G4, ECHO_V4, PORTS, m)
        }),
        Case::spoof("foreign IPv4 source", 0, move |m| {
            udp4_frame(
                mac,
                GUEST_MAC,
                Ipv4Addr::new(10, 66, 0, 5),
                ECHO_V4,
                PORTS,
                m,
            )
        }),
        Case::spoof("foreign source MAC", 0, move |m| {
            udp4_frame(mac, FOREIGN_MAC, G4, ECHO_V4, PORTS, m)
        }),
        Case::spoof("VLAN-tagged frame", 0, move |m| {
            let mut f = udp4_frame(mac, GUEST_MAC, G4, ECHO_V4, PORTS, m);
            f.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
            f
        }),
        Case::spoof("DHCP offer from the guest", 0, move |m| {
            udp4_frame(BROADCAST, GUEST_MAC, G4, Ipv4Addr::BROADCAST, (67, 68), m)
        }),
        Case::spoof("ICMP redirect to the namespace", 0, move |m| {
            icmp4_frame(mac, GUEST_MAC, G4, GW4, 5, m)
        }),
        Case::spoof_state(
            "forged ARP for the gateway",
            move || forged(&ns1, GW4),
            move |m| arp_reply_frame(mac, GUEST_MAC, (FOREIGN_MAC, GW4), (mac, GW4), m),
        ),
        Case::spoof_state(
            "forged ARP for the guest's address",
            move || forged(&ns2, G4),
            move |m| arp_reply_frame(mac, GUEST_MAC, (FOREIGN_MAC, G4), (mac, GW4), m),
        ),
    ];
    let before = drops(&guard, &plan);
    let ns = guest.netns().to_owned();
    let out = tokio::task::spawn_blocking(move || hostile::run(&ns, "eth0", &[inet], &cases, "v4"))
        .await
        .expect("run");
    assert_outcomes(&out);
    let after = drops(&guard, &plan);
    assert_eq!(
        moved(&before, &after),
        [
            ("arp", 2),
            ("ethertype", 1),
            ("ipv4_source", 1),
            ("mac", 1),
            ("server_message", 2)
        ]
        .into_iter()
        .collect(),
        "{after:?}"
    );
    // Honest traffic flows beside it: TCP through NAT, ARP resolution included.
    traffic::tcp_echo(guest.netns(), (ECHO_V4, 7).into(), T).expect("tcp v4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn ipv6_rules_mesh_block_gateway_and_link_local() {
    let (env, guard) = env();
    // `a`: a gateway VM (::/0 via host) with a routed block; `b`: mesh only, not a gateway.
    let a = env.plan(&vm("a", 1, r#","public_ipv6":"2001:db8:7::/56""#, VIA_HOST));
    let b = env.plan(&vm("b", 2, "", ""));
    for p in [&a, &b] {
        env.driver.apply(p).await.expect("apply");
    }
    let ga = env.guest("a", &a, &["::/0"], 1380);
    let gb = env.guest("b", &b, &["fdaa::/16"], 1380);
    let (ma, mb) = (tap_mac(&a), tap_mac(&b));
    let (mesh_a, mesh_b) = (v6("fdaa:1::1"), v6("fdaa:1::2"));
    let ll = GUEST_MAC.link_local_v6();
    let fe80_1 = v6("fe80::1");
    let inet = Capture::start(&env.sb.inet(), INET_UPLINK_IF).expect("capture inet");
    let at_b = Capture::start(gb.netns(), "eth0").expect("capture b");
    let (ns_ra, ns_redirect, tap_a) = (a.netns.clone(), a.netns.clone(), a.tap.name.clone());
    let cases = vec![
        Case::honest("mesh source to the internet", 0, move |m| {
            udp6_frame(ma, GUEST_MAC, mesh_a, ECHO_V6, PORTS, m)
        }),
        Case::honest("inside the routed block to the internet", 0, move |m| {
            udp6_frame(ma, GUEST_MAC, v6("2001:db8:7:ff::5"), ECHO_V6, PORTS, m)
        }),
        Case::spoof("outside the routed block to the internet", 0, move |m| {
            udp6_frame(ma, GUEST_MAC, v6("2001:db8:8::5"), ECHO_V6, PORTS, m)
        }),
        Case::honest(
            "a gateway forwarding an internet source to a mesh VM",
            1,
            move |m| udp6_frame(ma, GUEST_MAC, ECHO_V6, mesh_b, PORTS, m),
        ),
        Case::spoof(
            "an internet source to the internet from a gateway",
            0,
            move |m| udp6_frame(ma, GUEST_MAC, v6("2001:db8:bad::5"), ECHO_V6, PORTS, m),
        ),
        Case::spoof("another VM's mesh address to a mesh VM", 1, move |m| {
            udp6_frame(ma, GUEST_MAC, v6("fdaa:1::99"), mesh_b, PORTS, m)
        }),
        Case::spoof("link-local UDP to the namespace", 0, move |m| {
            udp6_frame(ma, GUEST_MAC, ll, fe80_1, PORTS, m)
        }),
        Case::spoof_state(
            "router advertisement into the namespace",
            move || {
                let addrs = netns::ip(&ns_ra, &["-6", "addr"]).unwrap_or_default();
                let routes = netns::ip(&ns_ra, &["-6", "route"]).unwrap_or_default();
                (addrs.contains("2001:db8:bad:1:") || routes.contains("2001:db8:bad:1:"))
                    .then(|| format!("{addrs}\n{routes}"))
            },
            move |m| {
                let all = v6("ff02::1");
                icmp6_message(
                    ALL_NODES_MAC,
                    GUEST_MAC,
                    ll,
                    all,
                    &router_advertisement(v6("2001:db8:bad:1::"), m),
                )
            },
        ),
        Case::spoof_state(
            "redirect into the namespace",
            move || {
                let r = netns::ip(&ns_redirect, &["-6", "route", "get", &ECHO_V6.to_string()])
                    .unwrap_or_default();
                r.contains(&format!("dev {tap_a}")).then_some(r)
            },
            move |m| icmp6_message(ma, GUEST_MAC, ll, fe80_1, &redirect(ll, ECHO_V6, m)),
        ),
    ];
    let before = drops(&guard, &a);
    let ns = ga.netns().to_owned();
    let out =
        tokio::task::spawn_blocking(move || hostile::run(&ns, "eth0", &[inet, at_b], &cases, "v6"))
            .await
            .expect("run");
    assert_outcomes(&out);
    assert_eq!(
        moved(&before, &drops(&guard, &a)),
        [
            ("ipv6_source", 2),
            ("link_local", 1),
            ("mesh_source", 1),
            ("server_message", 2)
        ]
        .into_iter()
        .collect()
    );

    // `b` is no gateway: an internet source to a mesh VM is a spoof; its own mesh source is not.
    let at_a = Capture::start(ga.netns(), "eth0").expect("capture a");
    let cases = vec![
        Case::honest("own mesh source to a mesh VM", 0, move |m| {
            udp6_frame(mb, GUEST_MAC, mesh_b, mesh_a, PORTS, m)
        }),
        Case::spoof(
            "an internet source to a mesh VM from a VM that is no gateway",
            0,
            move |m| udp6_frame(mb, GUEST_MAC, ECHO_V6, mesh_a, PORTS, m),
        ),
    ];
    let before = drops(&guard, &b);
    let ns = gb.netns().to_owned();
    let out = tokio::task::spawn_blocking(move || hostile::run(&ns, "eth0", &[at_a], &cases, "gw"))
        .await
        .expect("run");
    assert_outcomes(&out);
    assert_eq!(
        moved(&before, &drops(&guard, &b)),
        [("ipv6_source", 1)].into_iter().collect()
    );
    // Neighbour discovery still works: the namespaces resolve and reach the guests.
    traffic::ping(ga.netns(), mesh_b.into(), 1, T).expect("mesh ping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn the_namespace_ignores_what_a_guest_could_change_and_drift_repairs_its_settings() {
    let (env, _guard) = env();
    let plan = env.plan(&vm("s", 1, "", VIA_HOST));
    env.driver.apply(&plan).await.expect("apply");
    for (path, want) in plan.ns_sysctls.iter().chain(&plan.tap_sysctls) {
        let got = netns::sysctl_get(&plan.netns, path).expect("sysctl");
        assert_eq!(&got, want, "{path}");
    }
    let key = format!("net/ipv6/conf/{}/accept_ra", plan.tap.name);
    netns::sysctl(&plan.netns, &key, "2").expect("edit");
    let drift = env.driver.drift(&plan).await.expect("drift");
    assert!(
        drift.iter().any(|c| c.to_string().contains(&key)),
        "{drift:?}"
    );
    env.driver.apply(&plan).await.expect("repair");
    assert_eq!(netns::sysctl_get(&plan.netns, &key).expect("sysctl"), "0");
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn a_guard_detached_by_hand_fails_closed_until_an_apply_attaches_it_again() {
    let (env, guard) = env();
    let plan = env.plan(&vm("d", 1, "", VIA_HOST));
    env.driver.apply(&plan).await.expect("apply");
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("d", &plan, &["::/0"], 1380);
    traffic::udp_echo(guest.netns(), (ECHO_V4, 7).into(), T).expect("before");

    let tap = plan.tap.name.clone();
    vmnet_kernel::netns::run_in(&plan.netns, move || vmnet_kernel::guard::detach_here(&tap))
        .expect("netns")
        .expect("detach");
    // Unmarked, nothing the guest sends leaves the namespace: a spoof no more than the rest.
    let mac = tap_mac(&plan);
    let inet = Capture::start(&env.sb.inet(), INET_UPLINK_IF).expect("capture");
    let cases = vec![Case::spoof(
        "foreign IPv4 source without the guard",
        0,
        move |m| {
            udp4_frame(
                mac,
                GUEST_MAC,
                Ipv4Addr::new(10, 66, 0, 5),
                ECHO_V4,
                PORTS,
                m,
            )
        },
    )];
    let ns = guest.netns().to_owned();
    let out =
        tokio::task::spawn_blocking(move || hostile::run(&ns, "eth0", &[inet], &cases, "gone"))
            .await
            .expect("run");
    assert_outcomes(&out);
    assert!(
        traffic::try_udp_echo(guest.netns(), (ECHO_V4, 7).into(), Duration::from_secs(1))
            .expect("udp")
            .is_none(),
        "honest traffic must not leave unguarded either"
    );
    let drift = env.driver.drift(&plan).await.expect("drift");
    assert!(
        drift
            .iter()
            .any(|c| matches!(c, Change::Guard { what, .. } if what.contains("attached"))),
        "{drift:?}"
    );
    let repaired = env.driver.apply(&plan).await.expect("repair");
    assert!(
        repaired.iter().any(|c| matches!(c, Change::Guard { .. })),
        "{repaired:?}"
    );
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
    traffic::udp_echo(guest.netns(), (ECHO_V4, 7).into(), T).expect("after the repair");
    // A flushed table is repaired as well, the mark check with it.
    netns::exec(&plan.netns, "nft", &["flush", "ruleset"], T).expect("flush");
    assert!(!env.driver.drift(&plan).await.expect("drift").is_empty());
    env.driver.apply(&plan).await.expect("repair");
    assert!(
        ns_support::nft_ruleset(&plan.netns).contains("meta mark & 0x00400000 == 0x00000000 drop")
    );
    drop(guest);
    // Removing the VM forgets it.
    env.driver.remove(plan.user_id).await.expect("remove");
    assert!(guard.drops(plan.user_id).expect("counters").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn a_test_run_on_the_tap_passes_the_guests_frame_and_drops_a_spoof() {
    let (env, guard) = env();
    let plan = env.plan(&vm("r", 1, "", VIA_HOST));
    env.driver.apply(&plan).await.expect("apply");
    let mac = tap_mac(&plan);
    let run = |src: &str, repeat| {
        let frame = udp6_frame(mac, GUEST_MAC, v6(src), ECHO_V6, PORTS, b"cost");
        guard
            .test_run_in(&plan.netns, &plan.tap.name, &frame, repeat)
            .expect("test run")
    };
    let before = drops(&guard, &plan);
    let honest = run("fdaa:1::1", 1000);
    assert_eq!(honest.verdict, -1, "passed (TC_ACT_UNSPEC)");
    assert!(honest.per_frame > Duration::ZERO);
    assert_eq!(run("fdaa:1::9", 1).verdict, 2, "dropped (TC_ACT_SHOT)");
    assert_eq!(
        moved(&before, &drops(&guard, &plan)),
        BTreeMap::from([("mesh_source", 1)])
    );
    // A tap that is not there is an error naming it.
    let err = guard
        .test_run_in(&plan.netns, "no-such-tap", &[0u8; 64], 1)
        .expect_err("no such tap");
    assert!(err.to_string().contains("no-such-tap"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: creates network namespaces (scripts/test.sh runs it)"]
async fn a_new_agents_guard_takes_over_as_an_upgrade_not_drift() {
    let (mut env, _old) = env();
    let plan = env.plan(&vm("u", 1, "", VIA_HOST));
    env.driver.apply(&plan).await.expect("apply");
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("u", &plan, &["::/0"], 1380);
    traffic::udp_echo(guest.netns(), (ECHO_V4, 7).into(), T).expect("before");
    // A restarted agent: its own program and empty maps; the tap still runs the old program.
    let new = Arc::new(GuestGuard::load().expect("load the new guard"));
    env.driver = Arc::new(
        NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host()))
            .expect("driver")
            .with_guard(Arc::clone(&new)),
    );
    let changes = env.driver.apply(&plan).await.expect("take over");
    assert!(
        changes.iter().any(|c| matches!(c, Change::Upgrade { .. })),
        "{changes:?}"
    );
    assert!(
        changes.iter().all(|c| !c.is_drift()),
        "taking over is no drift: {changes:?}"
    );
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
    traffic::udp_echo(guest.netns(), (ECHO_V4, 7).into(), T).expect("after the take-over");
    assert!(new.drops(plan.user_id).expect("counters").is_some());
}
