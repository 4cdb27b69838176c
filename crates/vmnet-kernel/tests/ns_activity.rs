//! Packet activity with real packets (root required): TCP from the host side moves a VM's last
//! activity, ARP, NDP, ICMP, UDP, what the guest sends and the metadata-style TCP on the guest
//! link do not; two VMs are independent; a new program (agent restart) keeps the pinned times;
//! frames reach the guest byte-identical with and without the program; a filter deleted or
//! swapped by hand is drift and repaired.

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ns_support::{Env, T, v6, vm_json};
use vmnet_kernel::activity::ActivityRecorder;
use vmnet_kernel::ns::{Change, NetlinkNsDriver, NsDriver};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::probe::Capture;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6};
use vmnet_testkit::{netns, traffic};

/// Longer than the program's 1 ms write granularity, so a second packet shows as a move.
const PAUSE: Duration = Duration::from_millis(20);

fn mesh_vm(env: &Env, id: &str, uid: u32) -> vmnet_plan::ns::VmPlan {
    env.plan(&vm_json(
        id,
        uid,
        Some(&format!("fdaa:1::{uid:x}")),
        &[("0.0.0.0/0", "host"), ("::/0", "host")],
    ))
}

/// The stored time (boot clock, ns): exact, so two readings compare equal.
fn last(env: &Env, uid: u32) -> Option<u64> {
    env.recorder().last_boot_ns(uid).expect("read activity")
}

fn sock(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn only_tcp_from_the_host_side_moves_activity() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
    let _inet_echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("web", &plan, &["::/0"], 1380);
    let _guest_echo =
        EchoService::start(guest.netns(), &[sock("fdaa:1::1", 7), sock("0.0.0.0", 7)])
            .expect("guest echo");
    let capture = Capture::start(guest.netns(), "eth0").expect("capture");
    assert_eq!(last(&env, 1), None, "a new VM has no activity");

    // From the host side, everything but TCP: NDP and ICMPv6 (ping from the internet to the
    // mesh address), UDP from the internet, ARP, ICMP and UDP from the VM namespace itself.
    netns::ip(&plan.netns, &["neigh", "flush", "dev", &plan.tap.name]).expect("flush");
    let p = traffic::ping(&env.sb.inet(), IpAddr::V6(v6("fdaa:1::1")), 3, T).expect("ping6");
    assert_eq!(p.received, 3, "the guest answers pings from the internet");
    traffic::udp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("udp6 from the internet");
    let p =
        traffic::ping(&plan.netns, IpAddr::V4(Ipv4Addr::new(172, 16, 0, 2)), 3, T).expect("ping4");
    assert_eq!(p.received, 3);
    traffic::udp_echo(&plan.netns, sock("172.16.0.2", 7), T).expect("udp4 from the netns");
    let frames = capture.frames();
    assert!(
        frames.iter().any(|f| f.get(12..14) == Some(&[0x08, 0x06])),
        "the guest received ARP"
    );
    assert!(
        frames.iter().any(|f| f.get(12..14) == Some(&[0x86, 0xdd])
            && f.get(20) == Some(&58)
            && f.get(54) == Some(&135)),
        "the guest received a neighbour solicitation"
    );
    assert_eq!(last(&env, 1), None, "ARP, NDP, ICMP and UDP do not count");

    // What the guest sends: TCP to an address nobody answers, UDP and ICMP out.
    let silent = traffic::try_tcp_echo(
        guest.netns(),
        sock("198.51.100.99", 9),
        Duration::from_secs(1),
    )
    .expect("tcp out");
    assert!(silent.is_none(), "nobody answers 198.51.100.99");
    traffic::udp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("udp out");
    traffic::ping(guest.netns(), IpAddr::V4(ECHO_V4), 2, T).expect("ping out");
    assert_eq!(last(&env, 1), None, "what the guest sends does not count");

    // The metadata service's way: TCP between the guest and 169.254.169.254 in the VM netns.
    netns::ip(
        &plan.netns,
        &["addr", "add", "169.254.169.254/32", "dev", "lo"],
    )
    .expect("addr");
    let _mds = EchoService::start(&plan.netns, &[sock("169.254.169.254", 80)]).expect("mds");
    for _ in 0..3 {
        traffic::tcp_echo(guest.netns(), sock("169.254.169.254", 80), T).expect("metadata tcp");
    }
    assert_eq!(
        last(&env, 1),
        None,
        "TCP with 169.254.169.254 does not count"
    );

    // TCP from the internet to the guest (IPv6, the mesh address): counts.
    let before = SystemTime::now();
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp6 from the internet");
    let after = SystemTime::now();
    let t1 = last(&env, 1).expect("TCP from the host side counts");
    let t1_wall = env.recorder().last_of(1).expect("read").expect("active");
    let slack = Duration::from_millis(50);
    assert!(
        t1_wall + slack >= before && t1_wall <= after + slack,
        "the time is wall-clock time of the packet: {t1_wall:?} not within {before:?}..{after:?}"
    );
    // Replies to the guest's own IPv4 connection are TCP the guest receives: they count too.
    std::thread::sleep(PAUSE);
    traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("tcp4 out");
    // The connection's closing segments (TCP to the guest too) arrive just after the echo.
    std::thread::sleep(Duration::from_millis(300));
    let t2 = last(&env, 1).expect("activity");
    assert!(t2 > t1, "IPv4 TCP received by the guest moves the time");
    // Nothing else moves it afterwards either.
    std::thread::sleep(PAUSE);
    traffic::udp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("udp6");
    traffic::tcp_echo(guest.netns(), sock("169.254.169.254", 80), T).expect("metadata tcp");
    assert_eq!(last(&env, 1), Some(t2));
    let _ = ECHO_V6;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn two_vms_are_independent_and_removal_forgets() {
    let env = Env::with_activity();
    let a = mesh_vm(&env, "a", 1);
    let b = mesh_vm(&env, "b", 2);
    env.driver.apply(&a).await.expect("apply a");
    env.driver.apply(&b).await.expect("apply b");
    let ga = env.guest("a", &a, &["::/0"], 1380);
    let gb = env.guest("b", &b, &["::/0"], 1380);
    let _ea = EchoService::start(ga.netns(), &[sock("fdaa:1::1", 7)]).expect("echo a");
    let _eb = EchoService::start(gb.netns(), &[sock("fdaa:1::2", 7)]).expect("echo b");

    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::2", 7), T).expect("tcp to b");
    let tb = last(&env, 2).expect("b active");
    assert_eq!(last(&env, 1), None, "TCP to b leaves a untouched");
    // A mesh peer: a's guest connects to b's guest; b receives the SYN, a the SYN-ACK.
    std::thread::sleep(PAUSE);
    traffic::tcp_echo(ga.netns(), sock("fdaa:1::2", 7), T).expect("a → b over the mesh");
    let tb2 = last(&env, 2).expect("b");
    assert!(tb2 > tb, "a mesh peer's TCP moves b");
    assert!(
        last(&env, 1).is_some(),
        "a received the replies of its own connection"
    );

    env.driver.remove(2).await.expect("remove b");
    assert_eq!(last(&env, 2), None, "a removed VM's time is cleared");
    assert!(last(&env, 1).is_some(), "a keeps its time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn a_restarted_agent_replaces_the_program_and_keeps_the_times() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let guest = env.guest("web", &plan, &["::/0"], 1380);
    let _echo = EchoService::start(guest.netns(), &[sock("fdaa:1::1", 7)]).expect("echo");
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    // Let the connection's closing segments arrive: a stable time to compare.
    std::thread::sleep(Duration::from_millis(300));
    let t1 = last(&env, 1).expect("active");
    let old_id = env.recorder().program_id();

    // The agent restarts: a new program, loaded over the same pin root.
    let rec =
        Arc::new(ActivityRecorder::open(&env.activity.as_ref().expect("act").1.0).expect("reload"));
    assert_ne!(rec.program_id(), old_id, "a new program");
    assert_eq!(
        rec.last_boot_ns(1).expect("read"),
        Some(t1),
        "the pinned map kept the time"
    );
    // While no filter is replaced, the old program still records (into the same map).
    std::thread::sleep(PAUSE);
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    let t2 = rec.last_boot_ns(1).expect("read").expect("active");
    assert!(t2 > t1, "the old program writes the shared map");

    let driver = env.activity_driver(&rec);
    let drift = driver.drift(&plan).await.expect("drift");
    assert!(
        drift.iter().any(|c| matches!(c, Change::Upgrade { what, .. } if what.contains(&format!("runs bpf program {old_id}")))),
        "the old program's filter is to be swapped: {drift:?}"
    );
    assert!(
        drift.iter().all(|c| !c.is_drift()),
        "swapping an earlier agent's program is configure on start, not drift: {drift:?}"
    );
    driver
        .apply(&plan)
        .await
        .expect("apply with the new program");
    assert!(driver.drift(&plan).await.expect("drift").is_empty());
    let shown = netns::exec(
        &plan.netns,
        "tc",
        &["filter", "show", "dev", &plan.tap.name, "egress"],
        T,
    )
    .expect("tc");
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(
        shown.contains(&format!("id {}", rec.program_id())),
        "{shown}"
    );
    assert_eq!(
        shown.matches("handle 0xac7").count(),
        1,
        "one filter, swapped in place: {shown}"
    );
    std::thread::sleep(PAUSE);
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    assert!(
        rec.last_boot_ns(1).expect("read").expect("active") > t2,
        "the new program records"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn a_filter_deleted_by_hand_is_drift_and_is_repaired() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let del = [
        "filter",
        "del",
        "dev",
        &plan.tap.name,
        "egress",
        "pref",
        "49152",
    ];
    netns::exec(&plan.netns, "tc", &del, T).expect("tc del");
    let drift = env.driver.drift(&plan).await.expect("drift");
    assert!(
        drift
            .iter()
            .any(|c| matches!(c, Change::Tc { what, .. } if what.contains("no activity filter"))),
        "{drift:?}"
    );
    let changes = env.driver.apply(&plan).await.expect("repair");
    assert!(
        changes.iter().any(|c| matches!(c, Change::Tc { .. })),
        "{changes:?}"
    );
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn turning_activity_off_detaches_the_filter() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let shown = |plan: &vmnet_plan::ns::VmPlan| {
        let out = netns::exec(
            &plan.netns,
            "tc",
            &["filter", "show", "dev", &plan.tap.name, "egress"],
            T,
        )
        .expect("tc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(shown(&plan).contains("activity_out"), "{}", shown(&plan));
    // The agent restarts with packet activity off: no program loaded, no filter planned.
    let off = NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host())).expect("driver");
    let mut plan_off = plan.clone();
    plan_off.activity = None;
    let drift = off.drift(&plan_off).await.expect("drift");
    assert!(
        drift
            .iter()
            .any(|c| matches!(c, Change::Upgrade { what, .. } if what.contains("detach"))),
        "{drift:?}"
    );
    assert!(drift.iter().all(|c| !c.is_drift()), "not drift: {drift:?}");
    let changes = off.apply(&plan_off).await.expect("apply with activity off");
    assert!(
        changes.iter().any(|c| matches!(c, Change::Upgrade { .. })),
        "{changes:?}"
    );
    assert!(!shown(&plan).contains("activity_out"), "{}", shown(&plan));
    assert!(off.drift(&plan_off).await.expect("drift").is_empty());
    // Applying again changes nothing.
    assert!(off.apply(&plan_off).await.expect("apply").is_empty());
}

/// One IPv6 TCP segment with a fixed header and `marker` as payload, sent from `ns` to `dst`
/// port 9 `n` times over one raw socket (the kernel fills the checksum; the same socket gives
/// the same flow label).
fn raw_tcp6(ns: &str, dst: &str, marker: &[u8]) -> impl Fn() + use<> {
    let dst: std::net::Ipv6Addr = dst.parse().expect("address");
    let mut seg = vec![
        0x9c, 0x40, 0x00, 0x09, // ports 40000 → 9
        0, 0, 0, 1, 0, 0, 0, 1, // seq, ack
        0x50, 0x10, 0x10, 0x00, // header length 20, ACK, window
        0, 0, 0, 0, // checksum (kernel), urgent
    ];
    seg.extend(marker);
    let fd = netns::run_in(ns, || {
        nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet6,
            nix::sys::socket::SockType::Raw,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            nix::sys::socket::SockProtocol::Tcp,
        )
    })
    .expect("netns")
    .expect("raw socket");
    let offset: libc::c_int = 16;
    // SAFETY: `offset` is a valid int for IPV6_CHECKSUM on a valid raw socket.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_CHECKSUM,
            (&raw const offset).cast(),
            4,
        )
    };
    assert_eq!(rc, 0, "IPV6_CHECKSUM");
    move || {
        let to = nix::sys::socket::SockaddrIn6::from(std::net::SocketAddrV6::new(dst, 0, 0, 0));
        nix::sys::socket::sendto(
            fd.as_raw_fd(),
            &seg,
            &to,
            nix::sys::socket::MsgFlags::empty(),
        )
        .expect("send");
    }
}

fn frames_with(c: &Capture, marker: &[u8]) -> Vec<Vec<u8>> {
    c.frames()
        .into_iter()
        .filter(|f| f.windows(marker.len()).any(|w| w == marker))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn frames_are_byte_identical_with_and_without_the_program() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let guest = env.guest("web", &plan, &["::/0"], 1380);
    // A first packet resolves the neighbours, so both captures see the same path.
    traffic::ping(&env.sb.inet(), IpAddr::V6(v6("fdaa:1::1")), 1, T).expect("ping");
    let marker = b"vmnet-activity-identical";
    let send = raw_tcp6(&env.sb.inet(), "fdaa:1::1", marker);

    let with = Capture::start(guest.netns(), "eth0").expect("capture");
    send();
    assert!(with.saw(marker, T), "the segment reached the guest");
    let with = frames_with(&with, marker);
    assert!(last(&env, 1).is_some(), "the program saw the segment");

    let del = [
        "filter",
        "del",
        "dev",
        &plan.tap.name,
        "egress",
        "pref",
        "49152",
    ];
    netns::exec(&plan.netns, "tc", &del, T).expect("tc del");
    let without = Capture::start(guest.netns(), "eth0").expect("capture");
    let before = last(&env, 1);
    std::thread::sleep(PAUSE);
    send();
    assert!(without.saw(marker, T), "the segment reached the guest");
    let without = frames_with(&without, marker);
    assert_eq!(
        last(&env, 1),
        before,
        "without the filter nothing is recorded"
    );
    assert_eq!(with.len(), 1);
    assert_eq!(
        with, without,
        "headers and payload identical with and without the program"
    );
}
