//! Packet activity with real packets (root required): TCP from the host side moves a VM's last
//! activity, ARP, NDP, ICMP, UDP, what the guest sends and the metadata-style TCP on the guest
//! link do not; two VMs are independent, and so are two agents on one kernel; a new program
//! (agent restart) replaces the old one and keeps the pinned times; frames reach the guest
//! byte-identical with and without the program; an entry edited or deleted by hand, or the
//! link unpinned, is repaired; an earlier version's per-tap filter is deleted.

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ns_support::{Env, T, v6, vm_json};
use vmnet_kernel::activity::{ActivityRecorder, VmEntry};
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
    // `nud all`: the guest's permanent entries too (wake on packet's), so the namespace
    // resolves the guest by ARP and NDP again.
    netns::ip(
        &plan.netns,
        &["neigh", "flush", "dev", &plan.tap.name, "nud", "all"],
    )
    .expect("flush");
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

/// The ids of the programs of every BPF link on the host.
fn linked_programs() -> Vec<u32> {
    aya::programs::loaded_links()
        .filter_map(Result::ok)
        .map(|l| l.program_id())
        .collect()
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
    assert!(
        linked_programs().contains(&old_id),
        "the program is attached"
    );

    // The agent restarts: a new program, loaded over the same pin root. Its link's pin
    // replaces the old one, which detaches the old program.
    let rec =
        Arc::new(ActivityRecorder::open(&env.activity.as_ref().expect("act").1.0).expect("reload"));
    assert_ne!(rec.program_id(), old_id, "a new program");
    assert!(linked_programs().contains(&rec.program_id()));
    assert!(
        !linked_programs().contains(&old_id),
        "the old program is detached"
    );
    assert_eq!(
        rec.ensure_link().expect("link"),
        None,
        "the pin is the new link's"
    );
    assert_eq!(
        rec.last_boot_ns(1).expect("read"),
        Some(t1),
        "the pinned map kept the time"
    );
    // The registrations are in the pinned map too: nothing to repair.
    let driver = env.activity_driver(&rec);
    assert!(driver.drift(&plan).await.expect("drift").is_empty());
    std::thread::sleep(PAUSE);
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    assert!(
        rec.last_boot_ns(1).expect("read").expect("active") > t1,
        "the new program records"
    );
}

/// The pinned VM map of `env`'s recorder, opened by hand as another tool would.
fn vm_map(env: &Env) -> aya::maps::HashMap<aya::maps::MapData, u32, VmEntry> {
    let root = &env.activity.as_ref().expect("act").1.0;
    let data = aya::maps::MapData::from_pin(root.join("activity_vm")).expect("open the pinned map");
    aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect("hash map")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn an_entry_edited_or_deleted_by_hand_is_drift_and_is_repaired() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let guest = env.guest("web", &plan, &["::/0"], 1380);
    let _echo = EchoService::start(guest.netns(), &[sock("fdaa:1::1", 7)]).expect("echo");
    let inode = vmnet_kernel::activity::netns_inode(&plan.netns).expect("inode");
    let good = vm_map(&env).get(&inode, 0).expect("registered");
    assert_eq!(good.uid, 1);

    let edits: [(&str, Option<VmEntry>); 3] = [
        ("deleted", None),
        ("another user id", Some(VmEntry { uid: 2, ..good })),
        (
            "another tap",
            Some(VmEntry {
                tap: good.tap + 1,
                ..good
            }),
        ),
    ];
    for (what, edit) in edits {
        let mut m = vm_map(&env);
        match edit {
            None => m.remove(&inode).expect("delete"),
            Some(e) => m.insert(inode, e, 0).expect("edit"),
        }
        // With the entry wrong, TCP to the guest is not recorded for it.
        let before = last(&env, 1);
        std::thread::sleep(PAUSE);
        traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(last(&env, 1), before, "{what}: nothing recorded for the VM");
        let drift = env.driver.drift(&plan).await.expect("drift");
        assert!(
            drift
                .iter()
                .any(|c| matches!(c, Change::Activity { .. }) && c.is_drift()),
            "{what}: {drift:?}"
        );
        let changes = env.driver.apply(&plan).await.expect("repair");
        assert!(
            changes.iter().any(|c| matches!(c, Change::Activity { .. })),
            "{what}: {changes:?}"
        );
        assert!(
            env.driver.drift(&plan).await.expect("drift").is_empty(),
            "{what}"
        );
        assert_eq!(vm_map(&env).get(&inode, 0).expect("entry"), good, "{what}");
        std::thread::sleep(PAUSE);
        traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
        assert!(
            last(&env, 1) > before,
            "{what}: recorded again after the repair"
        );
        // The edit to another user id recorded under that id: cleared for the next round.
        env.recorder().forget(2).expect("forget 2");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn a_link_unpinned_by_hand_stops_recording_until_the_pass_repairs_it() {
    let env = Env::with_activity();
    let plan = mesh_vm(&env, "web", 1);
    env.driver.apply(&plan).await.expect("apply");
    let guest = env.guest("web", &plan, &["::/0"], 1380);
    let _echo = EchoService::start(guest.netns(), &[sock("fdaa:1::1", 7)]).expect("echo");
    let root = env.activity.as_ref().expect("act").1.0.clone();
    std::fs::remove_file(root.join("activity_link")).expect("unpin by hand");
    // The kernel releases an unpinned link from a work queue, and a tracepoint's program runs
    // until the release has waited out the readers already inside it: wait for both.
    let gone = std::time::Instant::now() + T;
    while linked_programs().contains(&env.recorder().program_id()) {
        assert!(
            std::time::Instant::now() < gone,
            "without its pin the program is detached"
        );
        std::thread::sleep(PAUSE);
    }
    std::thread::sleep(Duration::from_millis(200));
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    assert_eq!(last(&env, 1), None, "nothing is recorded while detached");
    // The pass's garbage collection checks the link and attaches the program again.
    env.driver.gc(&[1]).await.expect("gc");
    assert!(linked_programs().contains(&env.recorder().program_id()));
    assert_eq!(env.recorder().ensure_link().expect("link"), None);
    traffic::tcp_echo(&env.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp");
    assert!(last(&env, 1).is_some(), "recorded again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn two_agents_on_one_kernel_record_only_their_own_vms() {
    // Two agents with VMs of the same user id: their namespaces have the same device indexes
    // (derived veth end, tap), but each program finds only its own namespaces.
    let a = Env::with_activity();
    let b = Env::with_activity();
    let pa = mesh_vm(&a, "web", 1);
    let pb = mesh_vm(&b, "web", 1);
    a.driver.apply(&pa).await.expect("apply a");
    b.driver.apply(&pb).await.expect("apply b");
    let ga = a.guest("web", &pa, &["::/0"], 1380);
    let _ea = EchoService::start(ga.netns(), &[sock("fdaa:1::1", 7)]).expect("echo a");
    traffic::tcp_echo(&a.sb.inet(), sock("fdaa:1::1", 7), T).expect("tcp to a's VM");
    assert!(last(&a, 1).is_some(), "a's VM is active");
    assert_eq!(last(&b, 1), None, "b's VM of the same user id is not");
}

/// Puts a `cls_bpf` filter as earlier versions did on `tap`'s clsact egress in `netns`: a
/// program named `activity_out` (compiled here with clang; it does nothing) at their priority
/// and handle, left attached.
fn legacy_filter(netns: &str, tap: &str) {
    use aya::programs::tc::{NlOptions, TcAttachOptions};
    use vmnet_plan::ns::activity::{LEGACY_FILTER_HANDLE, LEGACY_FILTER_PRIORITY, LEGACY_PROGRAM};
    // The netns name is test-unique: so is this directory.
    let dir = std::env::temp_dir().join(format!("{netns}-legacy"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let src = dir.join("legacy.bpf.c");
    std::fs::write(
        &src,
        format!(
            "#include <linux/bpf.h>\n#include <bpf/bpf_helpers.h>\n\
             SEC(\"classifier\") int {LEGACY_PROGRAM}(struct __sk_buff *skb) {{ return -1; }}\n\
             char LICENSE[] SEC(\"license\") = \"GPL\";\n"
        ),
    )
    .expect("write");
    let obj = dir.join("legacy.o");
    let arch_include = format!("-I/usr/include/{}-linux-gnu", std::env::consts::ARCH);
    let status = std::process::Command::new("clang")
        .args(["-O2", "-target", "bpf", &arch_include, "-c"])
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .status()
        .expect("clang");
    assert!(status.success(), "clang");
    let mut bpf = aya::Ebpf::load_file(&obj).expect("load the object");
    let _ = std::fs::remove_dir_all(&dir);
    let prog: &mut aya::programs::SchedClassifier = bpf
        .program_mut(LEGACY_PROGRAM)
        .expect("program")
        .try_into()
        .expect("classifier");
    prog.load().expect("load");
    vmnet_kernel::netns::run_in(netns, || {
        let _ = aya::programs::tc::qdisc_add_clsact(tap);
        let opts = TcAttachOptions::Netlink(NlOptions {
            priority: LEGACY_FILTER_PRIORITY,
            handle: aya::programs::tc::TcHandle::from(LEGACY_FILTER_HANDLE),
            ..NlOptions::default()
        });
        let id = prog
            .attach_with_options(tap, aya::programs::TcAttachType::Egress, opts)
            .expect("attach");
        // Left on the tap when this program object goes, as an earlier agent's was.
        std::mem::forget(prog.take_link(id).expect("link"));
    })
    .expect("netns");
}

/// `drift` deletes an earlier version's per-tap filter, as configure on start, and is not
/// drift.
fn assert_deletes_the_earlier_filter(drift: &[Change]) {
    assert!(
        drift
            .iter()
            .any(|c| matches!(c, Change::Upgrade { what, .. } if what.contains("earlier version"))),
        "{drift:?}"
    );
    assert!(drift.iter().all(|c| !c.is_drift()), "not drift: {drift:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn an_earlier_versions_tap_filter_is_deleted_with_activity_on_or_off() {
    let env = Env::with_activity();
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
    let on = mesh_vm(&env, "on", 1);
    let off = mesh_vm(&env, "off", 2);
    env.driver.apply(&on).await.expect("apply");
    env.driver.apply(&off).await.expect("apply");
    for plan in [&on, &off] {
        assert!(!shown(plan).contains("activity_out"), "{}", shown(plan));
        legacy_filter(&plan.netns, &plan.tap.name);
        assert!(shown(plan).contains("activity_out"), "{}", shown(plan));
    }
    // An upgraded agent with packet activity on deletes it, as configure on start.
    let drift = env.driver.drift(&on).await.expect("drift");
    assert_deletes_the_earlier_filter(&drift);
    env.driver.apply(&on).await.expect("apply");
    assert!(!shown(&on).contains("activity_out"), "{}", shown(&on));
    assert!(env.driver.drift(&on).await.expect("drift").is_empty());
    // One with packet activity off (no program loaded, no entry planned) deletes it too.
    let driver_off =
        NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host())).expect("driver");
    let mut plan_off = off.clone();
    plan_off.activity = None;
    let drift = driver_off.drift(&plan_off).await.expect("drift");
    assert_deletes_the_earlier_filter(&drift);
    let changes = driver_off
        .apply(&plan_off)
        .await
        .expect("apply with activity off");
    assert!(
        changes.iter().any(|c| matches!(c, Change::Upgrade { .. })),
        "{changes:?}"
    );
    assert!(!shown(&off).contains("activity_out"), "{}", shown(&off));
    assert!(driver_off.drift(&plan_off).await.expect("drift").is_empty());
    // Applying again changes nothing.
    assert!(driver_off.apply(&plan_off).await.expect("apply").is_empty());
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

    assert!(env.recorder().detach_link().expect("detach"));
    let without = Capture::start(guest.netns(), "eth0").expect("capture");
    let before = last(&env, 1);
    std::thread::sleep(PAUSE);
    send();
    assert!(without.saw(marker, T), "the segment reached the guest");
    let without = frames_with(&without, marker);
    assert_eq!(
        last(&env, 1),
        before,
        "without the program nothing is recorded"
    );
    assert_eq!(with.len(), 1);
    assert_eq!(
        with, without,
        "headers and payload identical with and without the program"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and loads BPF (scripts/test.sh runs it)"]
async fn the_pin_root_of_a_killed_run_is_swept_and_its_program_detached() {
    // A run killed before its guard: a pin root named after a pid that no longer runs, its
    // program attached through the pinned link.
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let pid = child.id();
    child.wait().expect("wait");
    let root = std::env::temp_dir().join(format!("zz{:06x}00-bpf", pid & 0x3f_ffff));
    let id = {
        let rec = ActivityRecorder::open(&root).expect("load");
        rec.program_id()
    };
    assert!(linked_programs().contains(&id), "attached while pinned");
    let swept = vmnet_testkit::sandbox::sweep_stale_pin_roots();
    assert!(swept.contains(&root), "{swept:?}");
    assert!(!root.exists());
    assert!(!linked_programs().contains(&id), "detached once swept");
    // A live process's root stays.
    let env = Env::with_activity();
    let live = env.activity.as_ref().expect("act").1.0.clone();
    assert!(!vmnet_testkit::sandbox::sweep_stale_pin_roots().contains(&live));
    assert!(linked_programs().contains(&env.recorder().program_id()));
}
