//! Drift repaired on the kernel's change notifications (root required): an agent whose driver
//! listens to the notifications of its sandbox host and VM netns, with no reconcile pass
//! running at all, repairs each hand change of what it owns within a second, and real
//! packets flow again: guest → fake internet (UDP echo, through the VM's NAT, its firewall,
//! its limits and the guest guard) and fake internet → guest (TCP echo to the public address,
//! on the uplink's subnet, so the fake internet finds it by ARP: the host's proxy entry
//! answers). The uplink set down and up (which deletes its proxy entries without a
//! notification of their own) is repaired on the link's notification. An idle, converged
//! agent's passes write nothing. A storm of the same change, 100 times a second, is backed
//! off and keeps the agent's CPU bounded.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use common::Harness;
use serde_json::{Value, json};
use vmnet_kernel::guard::GuestGuard;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_kernel::watch::{Kind, Watcher, What};
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{NsSettings, PublicNeighbors, VmPlan, plan_vm};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::{GuestConfig, SimGuest};
use vmnet_testkit::nft::nft;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, HOST_UPLINK_IF, INET_UPLINK_IF, INET_UPLINK_V4};
use vmnet_testkit::{Sandbox, netns, traffic};

/// On the uplink's subnet (203.0.113.0/24): reached by ARP, answered by the proxy entry.
const PUB4: &str = "203.0.113.81";
const T: Duration = Duration::from_secs(3);
/// How long a repair by notification may take.
const REPAIRED_WITHIN: Duration = Duration::from_secs(1);

struct World {
    h: Harness,
    plan: VmPlan,
    guest: SimGuest,
    _echo: EchoService,
    _guest_echo: EchoService,
    _tmp: tempfile::TempDir,
    sb: Sandbox,
}

fn vm() -> Value {
    json!({"id": "nt", "user_id": 0x5a, "tenant": 1, "mesh_ipv6": "fdaa:1::5a",
        "public_ipv4": PUB4,
        "private_network_throughput_mibps": 100, "public_network_throughput_mibps": 50,
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": {"enabled": true,
            "inbound": [{"protocol": "tcp", "ports": "7", "prefixes": ["0.0.0.0/0"]},
                {"protocol": "icmp", "prefixes": ["0.0.0.0/0"]}],
            "outbound": [{"protocol": "udp", "ports": "7", "prefixes": ["198.51.100.10/32"]}]}})
}

/// A sandbox, an agent with notifications on (no reconcile loop: nothing but a notification
/// can repair), proxy entries on the uplink and the guest guard, one VM with a guest, the
/// fake internet's echo and the guest's.
async fn world(tag: &str) -> World {
    vmnet_testkit::require_root();
    let sb = Sandbox::new(tag).unwrap();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        uplink: Some(HOST_UPLINK_IF.into()),
        public_neighbors: PublicNeighbors::Proxy,
        guard: true,
        ..NsSettings::default()
    };
    let guard = Arc::new(GuestGuard::load().unwrap());
    let mut driver = NetlinkNsDriver::new(settings.clone(), Some(sb.host()))
        .unwrap()
        .with_guard(guard);
    let events = driver.watch_kernel().unwrap();
    let driver: Arc<dyn NsDriver> = Arc::new(driver);
    let tmp = tempfile::tempdir().unwrap();
    let h = Harness::open_with(tmp.path(), Arc::clone(&driver), settings.clone()).await;
    let _task = h.agent.start_watching(events);
    let v = vm();
    let (status, body) = h.put_vm(&v).await;
    assert!(status.is_success(), "{status} {body}");
    let plan = plan_vm(
        &parse_vm_config(v.to_string().as_bytes()).unwrap(),
        &settings,
    )
    .unwrap();
    let echo = sb.start_echo().unwrap();
    let guest = SimGuest::attach(
        &sb,
        "nt",
        &plan.netns,
        &plan.tap.name,
        &GuestConfig {
            mtu: 1380,
            ..GuestConfig::default()
        },
    )
    .unwrap();
    let guest_echo = EchoService::start(
        guest.netns(),
        &[SocketAddr::new(IpAddr::V4(Ipv4Addr::new(172, 16, 0, 2)), 7)],
    )
    .unwrap();
    let w = World {
        h,
        plan,
        guest,
        _echo: echo,
        _guest_echo: guest_echo,
        _tmp: tmp,
        sb,
    };
    w.traffic_flows("before any change");
    w
}

impl World {
    async fn status(&self) -> Value {
        let (_, st) = self.h.call(Method::GET, "/v1/status", None).await;
        st["reconcile"].clone()
    }

    fn traffic_flows(&self, step: &str) {
        // The fake internet asks again: the host's proxy entry must answer.
        forget_neighbour(&self.sb.inet());
        let out = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
        traffic::udp_echo(self.guest.netns(), out, T)
            .unwrap_or_else(|e| panic!("{step}: guest → internet: {e}"));
        let to = SocketAddr::new(PUB4.parse().unwrap(), 7);
        traffic::tcp_echo(&self.sb.inet(), to, T)
            .unwrap_or_else(|e| panic!("{step}: internet → guest: {e}"));
    }

    /// Waits until no check ran for 200 ms (the notifications of the traffic before are
    /// handled: a change made during a check of the same netns is left to the pass).
    async fn settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut last = self.status().await["notifications"]["checks_total"].clone();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = self.status().await["notifications"]["checks_total"].clone();
            if now == last {
                return;
            }
            assert!(Instant::now() < deadline, "checks keep running: {now}");
            last = now;
        }
    }

    /// Makes `change` (a command line), then waits until a notification repaired it; returns
    /// how long that took from the change, and checks that packets flow again.
    async fn repaired(&self, step: &str, change: impl FnOnce()) -> Duration {
        self.settled().await;
        let before = self.status().await;
        let repairs = before["notifications"]["repairs_total"].as_u64().unwrap();
        let passes = before["passes"].as_u64().unwrap();
        let start = Instant::now();
        change();
        let took = loop {
            let st = self.status().await;
            if st["notifications"]["repairs_total"].as_u64().unwrap() > repairs {
                break start.elapsed();
            }
            assert!(
                start.elapsed() < REPAIRED_WITHIN,
                "{step}: not repaired within {REPAIRED_WITHIN:?}: {st}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let st = self.status().await;
        assert_eq!(
            st["passes"].as_u64().unwrap(),
            passes,
            "{step}: no pass ran"
        );
        self.traffic_flows(step);
        eprintln!(
            "{step}: repaired {:.1} ms after the change (agent: change-to-repair {} µs)",
            took.as_secs_f64() * 1000.0,
            st["notifications"]["last_change_to_repair_us"]
        );
        took
    }
}

/// Deletes the first rule of table `inet <table>` in `ns` whose line contains every needle.
fn delete_rule(ns: &str, table: &str, needles: &[&str]) {
    let listing = nft(ns, &["-a", "list", "table", "inet", table]).unwrap();
    let mut chain = None;
    for line in listing.lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("chain ") {
            chain = c.split_whitespace().next().map(str::to_owned);
        } else if needles.iter().all(|n| line.contains(n))
            && let Some((_, handle)) = line.rsplit_once("# handle ")
        {
            let chain = chain.clone().expect("a rule inside a chain");
            nft(
                ns,
                &[
                    "delete",
                    "rule",
                    "inet",
                    table,
                    &chain,
                    "handle",
                    handle.trim(),
                ],
            )
            .unwrap();
            return;
        }
    }
    panic!("no rule with {needles:?} in {ns}:\n{listing}");
}

fn proxies(host: &str) -> String {
    netns::ip(host, &["neigh", "show", "proxy"]).unwrap()
}

/// The uplink set down and up: the kernel deletes its proxy entries with the link (no
/// notification of their own); the link's notification has them put back, and the public
/// address answers the fake internet's ping within a second of the link coming up.
async fn uplink_flap_is_repaired(w: &World) {
    let host = w.sb.host();
    let inet = w.sb.inet();
    w.settled().await;
    let before = w.status().await;
    netns::ip(&host, &["link", "set", HOST_UPLINK_IF, "down"]).unwrap();
    // The kernel deletes the entry with the link; on a loaded host the agent may have put it
    // back already, which its repair count then shows.
    if proxies(&host).contains(PUB4) {
        let now = w.status().await;
        assert!(
            now["notifications"]["repairs_total"].as_u64()
                > before["notifications"]["repairs_total"].as_u64(),
            "the entry stayed with the link down, and no repair put it back: {now}"
        );
    }
    netns::ip(&host, &["link", "set", HOST_UPLINK_IF, "up"]).unwrap();
    let up = Instant::now();
    forget_neighbour(&inet);
    let target: IpAddr = PUB4.parse().unwrap();
    loop {
        let r = traffic::ping(&inet, target, 1, Duration::from_millis(100)).unwrap();
        if r.received == 1 {
            break;
        }
        assert!(
            up.elapsed() < REPAIRED_WITHIN,
            "no answer within {REPAIRED_WITHIN:?} of the uplink coming up; proxy entries: {}",
            proxies(&host)
        );
    }
    eprintln!(
        "uplink down and up: the public address answers {:.1} ms after up",
        up.elapsed().as_secs_f64() * 1000.0
    );
    assert!(proxies(&host).contains(PUB4), "{}", proxies(&host));
    let after = w.status().await;
    assert_eq!(after["passes"], before["passes"], "no pass ran");
    assert!(
        after["notifications"]["repairs_total"].as_u64()
            > before["notifications"]["repairs_total"].as_u64(),
        "{after}"
    );
    // The kernel deleted the sandbox's default route with the link (the sandbox's, not
    // vmnet's: a real host's network manager puts it back).
    netns::ip(
        &host,
        &[
            "route",
            "replace",
            "default",
            "via",
            &INET_UPLINK_V4.to_string(),
        ],
    )
    .unwrap();
    w.traffic_flows("after the uplink flap");
}

/// A VM routing via the VM's mesh address gets its route back with the gateway: IPv6 turned
/// off on the gateway's host veth end takes the route out of the other VM's table, and only
/// the gateway's own objects are notified.
async fn gateway_repair_reaches_the_vms_behind_it(w: &World) {
    let behind = json!({"id": "nb", "user_id": 0x5b, "tenant": 1, "mesh_ipv6": "fdaa:1::5b",
        "network": {"routes": [{"destination": "2000::/3", "via": "fdaa:1::5a"}]}});
    let (status, body) = w.h.put_vm(&behind).await;
    assert!(status.is_success(), "{status} {body}");
    let table = w.plan.host_table + 1;
    let gw = w.plan.veth.as_ref().unwrap().host_name.clone();
    let host = w.sb.host();
    let route = || {
        let out = netns::ip(&host, &["-6", "route", "show", "table", &table.to_string()]);
        out.unwrap_or_default()
    };
    let through = |r: &str| r.contains("2000::/3 via") && r.contains(&format!("dev {gw}"));
    assert!(through(&route()), "before: {}", route());
    w.settled().await;
    let sysctl = format!("net.ipv6.conf.{gw}.disable_ipv6=1");
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &host, "sysctl", "-qw", &sysctl])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let start = Instant::now();
    while !through(&route()) {
        assert!(
            start.elapsed() < REPAIRED_WITHIN * 2,
            "the route via the gateway is not back: {}",
            route()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "VM behind the gateway: route back {:?} after the change",
        start.elapsed()
    );
}

/// Two full passes of an idle, converged agent write nothing: a listener of its own, in the
/// host and the VM netns, sees no change to a link, address, route, rule, proxy or permanent
/// neighbour entry, tc object or nf_tables object.
async fn idle_passes_write_nothing(w: &World) {
    w.settled().await;
    let (listener, mut events) = Watcher::start(Some(&w.sb.host())).unwrap();
    listener.watch(&w.plan.netns).unwrap();
    for _ in 0..2 {
        let o = w.h.agent.reconcile().await.unwrap();
        assert!(o.errors.is_empty() && o.repaired.is_empty(), "{o:?}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut seen = Vec::new();
    while let Ok(ev) = events.try_recv() {
        // Entries learned from traffic are the kernel's, not vmnet's.
        if let What::Changed(n) = &ev.what
            && n.kind == Some(Kind::Neigh)
            && !(n.proxy || n.permanent)
        {
            continue;
        }
        seen.push(ev);
    }
    listener.stop();
    assert!(seen.is_empty(), "idle passes changed the kernel: {seen:#?}");
}

/// Deletes the fake internet's neighbour entry of the public address (if any).
fn forget_neighbour(inet: &str) {
    let _ = netns::ip(inet, &["neigh", "del", PUB4, "dev", INET_UPLINK_IF]);
}

fn tc(ns: &str, args: &[&str]) -> std::process::Output {
    netns::exec(ns, "tc", args, T).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn each_change_to_an_owned_object_is_repaired_on_its_notification_within_a_second() {
    let w = world("nn").await;
    let ns = w.plan.netns.clone();
    let table = w.sb.agent_prefix();
    let peer = w.plan.veth.as_ref().unwrap().peer_name.clone();
    let host = w.sb.host();
    let mut times = Vec::new();

    times.push(
        w.repaired("NAT rule deleted", || {
            delete_rule(&ns, &table, &["snat"]);
        })
        .await,
    );
    times.push(
        w.repaired("firewall rule deleted", || {
            delete_rule(&ns, &table, &["udp dport 7", "198.51.100.10"]);
        })
        .await,
    );
    times.push(
        w.repaired("host route deleted", || {
            netns::ip(&host, &["route", "del", PUB4]).unwrap();
        })
        .await,
    );
    let classes =
        String::from_utf8_lossy(&tc(&ns, &["class", "show", "dev", &peer]).stdout).into_owned();
    assert!(classes.contains("class htb 1:20"), "{classes}");
    times.push(
        w.repaired("HTB class deleted", || {
            // A class with a filter pointing to it cannot be deleted: the filters first.
            let _ = tc(&ns, &["filter", "del", "dev", &peer]);
            let out = tc(&ns, &["class", "del", "dev", &peer, "classid", "1:20"]);
            assert!(out.status.success(), "{out:?}");
        })
        .await,
    );
    let classes =
        String::from_utf8_lossy(&tc(&ns, &["class", "show", "dev", &peer]).stdout).into_owned();
    assert!(classes.contains("class htb 1:20"), "back: {classes}");
    times.push(
        w.repaired("VM veth end set down", || {
            netns::ip(&ns, &["link", "set", &peer, "down"]).unwrap();
        })
        .await,
    );
    times.push(
        w.repaired("proxy entry deleted", || {
            netns::ip(
                &host,
                &["neigh", "del", "proxy", PUB4, "dev", HOST_UPLINK_IF],
            )
            .unwrap();
        })
        .await,
    );
    assert!(proxies(&host).contains(PUB4), "back: {}", proxies(&host));
    let tap = w.plan.tap.name.clone();
    let guard_pref = |ns: &str| {
        let out = tc(ns, &["filter", "show", "dev", &tap, "ingress"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find(|l| l.contains(" bpf "))
            .and_then(|l| l.split_whitespace().skip_while(|w| *w != "pref").nth(1))
            .map(str::to_owned)
    };
    let pref = guard_pref(&ns).expect("the guard's filter on the tap");
    times.push(
        w.repaired("guard's BPF filter deleted from the tap", || {
            let out = tc(
                &ns,
                &["filter", "del", "dev", &tap, "ingress", "pref", &pref],
            );
            assert!(out.status.success(), "{out:?}");
            assert_eq!(guard_pref(&ns), None, "deleted");
        })
        .await,
    );
    assert!(guard_pref(&ns).is_some(), "the guard's filter is back");
    uplink_flap_is_repaired(&w).await;
    let counters = w.status().await["repairs"].clone();
    eprintln!("repair counters: {counters}");
    for kind in [
        "nft_rule",
        "route",
        "tc_class",
        "link",
        "neighbour",
        "tc_filter",
    ] {
        assert!(
            counters["by_kind"][kind]["notification"].as_u64().unwrap() >= 1,
            "{kind}: {counters}"
        );
    }
    assert_eq!(counters["by_trigger"]["pass"], 0, "{counters}");
    assert!(counters["change_to_repair"]["count"].as_u64().unwrap() >= 8);
    assert!(counters["change_to_repair"]["p99_us"].as_u64().unwrap() < 1_000_000);
    idle_passes_write_nothing(&w).await;

    // Nothing changed: nothing is checked, nothing repaired, nothing written.
    w.settled().await;
    let before = w.status().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = w.status().await;
    assert_eq!(
        before["notifications"]["checks_total"], after["notifications"]["checks_total"],
        "idle: {after}"
    );
    // The agent's own change (a re-PUT with another limit) is not taken for drift.
    let mut v = vm();
    v["public_network_throughput_mibps"] = json!(40);
    let (status, _) = w.h.put_vm(&v).await;
    assert!(status.is_success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let own = w.status().await;
    assert_eq!(
        own["notifications"]["repairs_total"], after["notifications"]["repairs_total"],
        "own change: {own}"
    );
    let ms: Vec<String> = times
        .iter()
        .map(|t| format!("{:.1}", t.as_secs_f64() * 1000.0))
        .collect();
    eprintln!("change-to-repair (ms): {}", ms.join(", "));
    gateway_repair_reaches_the_vms_behind_it(&w).await;
}

/// CPU time (user + system, clock ticks) of this whole process, the threads that ended
/// included (`/proc/self/stat` counts them; a list of the live threads would lose the time of
/// tokio's blocking threads that exit while they are idle).
fn process_ticks() -> u64 {
    ticks_of("/proc/self/stat")
}

/// CPU time of the calling thread, clock ticks.
fn own_thread_ticks() -> u64 {
    ticks_of("/proc/thread-self/stat")
}

fn ticks_of(path: &str) -> u64 {
    let stat = std::fs::read_to_string(path).unwrap();
    let (_, rest) = stat.rsplit_once(") ").unwrap();
    // After the comm: state is field 3; utime and stime are fields 14 and 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_storm_of_the_same_change_is_backed_off_and_the_agent_stays_calm() {
    let w = world("ns").await;
    let ns = w.plan.netns.clone();
    let table = w.sb.agent_prefix();
    w.settled().await;
    eprintln!(
        "{}",
        nft(&ns, &["-a", "list", "table", "inet", &table]).unwrap()
    );
    eprintln!(
        "{:?}",
        nft(&ns, &["flush", "chain", "inet", &table, "postrouting"])
    );
    eprintln!(
        "{}",
        nft(&ns, &["-a", "list", "table", "inet", &table]).unwrap()
    );
    let before = w.status().await;
    let cpu0 = process_ticks();
    let start = Instant::now();
    // The storm: the VM's NAT rules deleted 100 times a second for 5 s.
    let storm_ns = ns.clone();
    let storm_table = table.clone();
    let storm = std::thread::Builder::new()
        .name("storm".into())
        .spawn(move || {
            let mut n = 0;
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                let _ = nft(
                    &storm_ns,
                    &["flush", "chain", "inet", &storm_table, "postrouting"],
                );
                n += 1;
                let next = t0 + Duration::from_millis(10 * n);
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            (n, own_thread_ticks())
        })
        .unwrap();
    let (n, storm_ticks) = tokio::task::spawn_blocking(move || storm.join().unwrap())
        .await
        .unwrap();
    let wall = start.elapsed();
    // The agent runs in this process: everything the process spent but the storm's thread
    // (the test's own polling is in it too, so this bounds the agent's share from above).
    let all = process_ticks() - cpu0;
    let cpu = all.saturating_sub(storm_ticks);
    let hz = 100.0; // USER_HZ
    let share = cpu as f64 / hz / wall.as_secs_f64();
    let after = w.status().await;
    let checks = after["notifications"]["checks_total"].as_u64().unwrap()
        - before["notifications"]["checks_total"].as_u64().unwrap();
    let repairs = after["notifications"]["repairs_total"].as_u64().unwrap()
        - before["notifications"]["repairs_total"].as_u64().unwrap();
    let backoffs = after["notifications"]["backoffs_total"].as_u64().unwrap();
    eprintln!(
        "storm: {n} flushes in {:.1} s; the process's CPU but the storm's {cpu} ticks ({all} with it), {:.1} % of a core; {checks} checks, {repairs} repairs, {backoffs} back-offs",
        wall.as_secs_f64(),
        share * 100.0
    );
    assert!(n >= 300, "the storm ran ({n} flushes)");
    assert!(backoffs > 0, "backed off: {after}");
    assert!(checks <= 40, "checks bounded by the back-off: {checks}");
    assert!(share < 0.3, "agent CPU {:.1} % of a core", share * 100.0);
    // After the storm the last change is repaired (the back-off ends at the latest after the
    // reconcile interval; here it is far shorter) and packets flow.
    let deadline = Instant::now() + Duration::from_secs(15);
    while nft(&ns, &["list", "chain", "inet", &table, "postrouting"])
        .unwrap()
        .lines()
        .all(|l| !l.contains("snat"))
    {
        assert!(Instant::now() < deadline, "repaired after the storm");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.traffic_flows("after the storm");
}
