//! Drift of the public address state (root required): each VM's map elements, its public
//! routes and proxy entries are read back and compared by content, and a hand edit is reported
//! and repaired in place; the host table's rules are compared without the elements. Removing
//! one VM of many leaves every other VM's elements, routes and proxy entries exactly as they
//! were, and nothing of its own.

mod ns_support;

use std::net::{IpAddr, SocketAddr};

use ns_support::{Env, T};
use vmnet_kernel::ns::Change;
use vmnet_plan::ns::{PublicNeighbors, VmPlan};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::nft::nft;
use vmnet_testkit::sandbox::{HOST_UPLINK_IF, HOST_UPLINK_V4, INET_UPLINK_V4};
use vmnet_testkit::{netns, traffic};

fn vm(env: &Env, uid: u32, v4: &str, v6: &str) -> VmPlan {
    let v4 = if v4.is_empty() {
        String::new()
    } else {
        format!(r#""public_ipv4":"{v4}","#)
    };
    env.plan(&format!(
        r#"{{"id":"v{uid}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid:x}",
        {v4}"public_ipv6":"{v6}",
        "network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}},{{"destination":"::/0","via":"host"}}]}}}}"#
    ))
}

/// The `i`-th of the 768 IPv4 documentation addresses (192.0.2.0/24, 198.51.100.0/24,
/// 203.0.113.0/24), or nothing past them: a VM beyond the 768th gets only a public IPv6.
fn doc_v4(i: u32) -> String {
    let nets = ["192.0.2", "198.51.100", "203.0.113"];
    nets.get((i / 256) as usize)
        .map(|n| format!("{n}.{}", i % 256))
        .unwrap_or_default()
}

fn table(env: &Env) -> String {
    format!("{}_pub", env.settings.name_prefix)
}

/// Runs `program ARGS` on a thread inside `ns` (no `ip -n`/`ip netns exec`: those copy every
/// namespace mount, slow with a thousand VMs); its standard output.
fn run_in(ns: &str, program: &str, args: &[&str]) -> String {
    let (program, args) = (
        program.to_owned(),
        args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>(),
    );
    let out = netns::run_in(ns, move || {
        std::process::Command::new(&program).args(&args).output()
    })
    .expect("netns")
    .expect("run");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Everything public on the host: the public table with its elements (one element a line,
/// sorted), the static routes and the proxy entries.
fn public_state(env: &Env) -> Vec<String> {
    let host = env.sb.host();
    let mut text = run_in(&host, "nft", &["list", "table", "inet", &table(env)]);
    for args in [
        &["route", "show", "proto", "static"][..],
        &["-6", "route", "show", "proto", "static"],
        &["neigh", "show", "proxy"],
        &["-6", "neigh", "show", "proxy"],
    ] {
        text.push_str(&run_in(&host, "ip", args));
    }
    let mut lines: Vec<String> = text
        .lines()
        .flat_map(|l| {
            l.split(", ")
                .map(|e| e.trim().trim_end_matches(',').to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort();
    lines
}

fn repairs(changes: &[Change]) -> Vec<String> {
    changes.iter().map(ToString::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn hand_edits_of_elements_routes_proxies_and_the_table_are_drift_repaired_in_place() {
    let env = Env::with(|s| {
        s.uplink = Some(HOST_UPLINK_IF.into());
        s.public_neighbors = PublicNeighbors::Proxy;
    });
    let a = vm(&env, 1, "203.0.113.61", "2001:db8:0:1::61");
    let b = vm(&env, 2, "203.0.113.62", "2001:db8:0:1::62");
    env.driver.apply(&a).await.expect("apply a");
    env.driver.apply(&b).await.expect("apply b");
    let good = public_state(&env);
    let host = env.sb.host();
    let t = table(&env);
    let inet = env.sb.inet();
    let g = env.guest("a", &a, &["::/0"], 1380);
    let _svc = EchoService::start(
        g.netns(),
        &[SocketAddr::new("172.16.0.2".parse().unwrap(), 7)],
    )
    .expect("echo");
    let reach = || traffic::try_tcp_echo(&inet, "203.0.113.61:7".parse().unwrap(), T);
    assert_eq!(
        reach().unwrap().unwrap().peer.ip(),
        IpAddr::V4(INET_UPLINK_V4)
    );

    // Each hand edit: reported by drift (naming it), repaired by one apply, state as before.
    let edits: Vec<(&str, Vec<String>, &str)> = vec![
        (
            "dnat4 element deleted",
            vec!["delete", "element", "inet", &t, "dnat4", "{ 203.0.113.61 }"]
                .into_iter()
                .map(String::from)
                .collect(),
            "public IPv4 elements",
        ),
        (
            "snat6 element deleted",
            vec!["delete", "element", "inet", &t, "snat6", "{ fdaa:1::1 }"]
                .into_iter()
                .map(String::from)
                .collect(),
            "public IPv6 elements",
        ),
        (
            "own6 element deleted",
            vec!["delete", "element", "inet", &t, "own6", "{ 10.200.0.6 }"]
                .into_iter()
                .map(String::from)
                .collect(),
            "public IPv6 elements",
        ),
    ];
    for (what, cmd, needle) in edits {
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        nft(&host, &args).expect(what);
        let d = repairs(&env.driver.drift(&a).await.expect("drift"));
        assert!(d.iter().any(|l| l.contains(needle)), "{what}: {d:?}");
        env.driver.apply(&a).await.expect("repair");
        assert_eq!(env.driver.drift(&a).await.expect("drift"), vec![], "{what}");
        assert_eq!(public_state(&env), good, "{what}: repaired exactly");
    }
    // The public /32 route and a proxy entry deleted by hand.
    netns::ip(&host, &["route", "del", "203.0.113.61/32"]).expect("route del");
    netns::ip(
        &host,
        &[
            "-6",
            "neigh",
            "del",
            "proxy",
            "2001:db8:0:1::61",
            "dev",
            HOST_UPLINK_IF,
        ],
    )
    .expect("neigh del");
    let d = repairs(&env.driver.drift(&a).await.expect("drift"));
    assert!(
        d.iter().any(|l| l.contains("add route 203.0.113.61/32")),
        "{d:?}"
    );
    assert!(
        d.iter()
            .any(|l| l.contains("add proxy neighbour 2001:db8:0:1::61")),
        "{d:?}"
    );
    env.driver.apply(&a).await.expect("repair");
    assert_eq!(
        public_state(&env),
        good,
        "routes and proxies repaired exactly"
    );
    // The /32 replaced by hand (another protocol and type), then the host veth set down (the
    // kernel flushes its IPv4 routes without a notification): each seen and repaired.
    let host_veth = a.veth.as_ref().expect("a has a veth").host_name.clone();
    for (what, args) in [
        (
            "route replaced",
            vec!["route", "replace", "blackhole", "203.0.113.61/32"],
        ),
        ("veth down", vec!["link", "set", host_veth.as_str(), "down"]),
    ] {
        netns::ip(&host, &args).expect(what);
        let d = repairs(&env.driver.drift(&a).await.expect("drift"));
        assert!(
            d.iter().any(|l| l.contains("203.0.113.61/32")),
            "{what}: {d:?}"
        );
        env.driver.apply(&a).await.expect("repair");
        assert_eq!(env.driver.drift(&a).await.expect("drift"), vec![], "{what}");
        assert_eq!(public_state(&env), good, "{what}: repaired exactly");
    }

    // A rule of the public table deleted: host drift; the table is replaced and each VM's
    // apply puts its elements back.
    nft(&host, &["flush", "chain", "inet", &t, "postrouting"]).expect("flush");
    let d = repairs(&env.driver.drift(&a).await.expect("drift"));
    assert!(
        d.iter()
            .any(|l| l.contains(&t) || l.contains("postrouting")),
        "{d:?}"
    );
    env.driver.apply(&a).await.expect("repair a");
    env.driver.apply(&b).await.expect("repair b");
    assert_eq!(public_state(&env), good, "table and elements back");
    assert_eq!(
        reach().unwrap().unwrap().peer.ip(),
        IpAddr::V4(INET_UPLINK_V4),
        "still reached"
    );
    let _ = HOST_UPLINK_V4;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn removing_one_vm_of_many_leaves_every_other_vm_exactly_as_it_was() {
    let n: u32 = std::env::var("VMNET_PUBLIC_VMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let env = Env::with(|s| {
        s.uplink = Some(HOST_UPLINK_IF.into());
        s.public_neighbors = PublicNeighbors::Proxy;
    });
    let plans: Vec<VmPlan> = (1..=n)
        .map(|u| vm(&env, u, &doc_v4(u - 1), &format!("2001:db8:9::{u:x}")))
        .collect();
    for p in &plans {
        env.driver.apply(p).await.expect("apply");
    }
    let all = public_state(&env);
    let victim = n / 2;
    env.driver.remove(victim).await.expect("remove");
    let after = public_state(&env);
    let v = &plans[victim as usize - 1];
    let pp = v.public.as_ref().unwrap();
    let mine: Vec<String> = [
        pp.ipv4.map(|a| a.to_string()).unwrap_or_default(),
        pp.ipv6.unwrap().to_string(),
        pp.transit.to_string(),
        v.guest.mesh_ipv6.unwrap().to_string(),
    ]
    .into_iter()
    .collect();
    let is_mine = |l: &str| {
        mine.iter().any(|m| {
            l.split(|c: char| !(c.is_ascii_hexdigit() || c == '.' || c == ':'))
                .any(|w| w == m)
        })
    };
    let expected: Vec<String> = all.iter().filter(|l| !is_mine(l)).cloned().collect();
    assert_eq!(
        after, expected,
        "every other VM's state unchanged, none of the removed one's"
    );
    assert!(all.len() > after.len(), "the removed VM had state");
    let _ = netns::ip(&env.sb.host(), &["route"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn public_state_of_a_vm_whose_netns_is_gone_is_collected() {
    let env = Env::with(|s| {
        s.uplink = Some(HOST_UPLINK_IF.into());
        s.public_neighbors = PublicNeighbors::Proxy;
    });
    let a = vm(&env, 1, "203.0.113.71", "2001:db8:0:1::71");
    let b = vm(&env, 2, "203.0.113.72", "2001:db8:0:1::72");
    env.driver.apply(&a).await.expect("apply a");
    let only_b = {
        env.driver.apply(&b).await.expect("apply b");
        let all = public_state(&env);
        env.driver.remove(1).await.expect("remove a");
        let s = public_state(&env);
        env.driver.apply(&a).await.expect("apply a again");
        assert_eq!(public_state(&env), all);
        s
    };
    // A's netns and veth pair go away behind the driver's back (a reboot would take them too);
    // its elements, public route and proxy entries stay on the host.
    netns::delete(&a.netns).expect("delete a's netns");
    let host_veth = &a.veth.as_ref().expect("a has a veth pair").host_name;
    let host = env.sb.host();
    let _ = netns::ip(&host, &["link", "del", host_veth]);
    // Its policy rules and routing table too: nothing names user id 1 but the public state.
    for fam in ["-4", "-6"] {
        while netns::ip(&host, &[fam, "rule", "del", "iif", host_veth]).is_ok() {}
        let t = a.host_table.to_string();
        let _ = netns::ip(&host, &[fam, "route", "flush", "table", &t]);
    }
    assert!(
        public_state(&env)
            .iter()
            .any(|l| l.contains("203.0.113.71")),
        "a's public state is still there"
    );
    let collected = env.driver.gc(&[2]).await.expect("gc");
    assert_eq!(collected, vec![1], "a collected, by its elements");
    assert_eq!(
        public_state(&env),
        only_b,
        "none of a's elements, routes or proxy entries left; b's exactly as before"
    );
}
