//! Namespace mode repairs in place (root required): with a process holding the VM's tap open
//! (the testkit's frame relay, as a VMM does), adding a mesh address, losing the veth pair or
//! one end of it, changing the mesh address, the MTU, the tap's address or the transit range
//! each keep the netns (same inode) and the tap (same ifindex), and the guest keeps exchanging
//! frames through the held tap after each repair. Drift made behind the driver's back (a half-made
//! netns, changed objects, the veth ends' neighbour entries, MACs and addresses, IPv6 turned off
//! on a veth end) is reported and repaired.

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use ns_support::{Env, T, link_info, vm_json};
use vmnet_kernel::ns::{Change, NetlinkNsDriver, NsDriver};
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{NsSettings, VmPlan, plan_vm};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::SimGuest;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4};
use vmnet_testkit::{netns, traffic};

/// What must stay the same across every repair, and the traffic that must keep passing.
struct Held {
    netns: String,
    tap: String,
    tap_index: u32,
    inode: u64,
    guest: SimGuest,
}

fn inode(ns: &str) -> u64 {
    std::fs::metadata(netns::path(ns)).expect("netns").ino()
}

impl Held {
    /// Applies `plan` through `driver`; asserts it was a repair in place (no create, no remove,
    /// same netns inode and tap ifindex) whose changes match `expect`, that a second apply
    /// changes nothing, and that the guest still reaches the fake internet through the held
    /// tap (NAT to the sandbox uplink) with frames copied by the relay.
    async fn repair(
        &self,
        driver: &dyn NsDriver,
        plan: &VmPlan,
        step: &str,
        expect: impl Fn(&Change) -> bool,
    ) {
        let before = self.guest.relay().stats();
        let changes = driver.apply(plan).await.expect(step);
        assert!(changes.iter().any(&expect), "{step}: {changes:?}");
        assert!(
            !changes
                .iter()
                .any(|c| matches!(c, Change::CreateVm { .. } | Change::RemoveVm { .. })),
            "{step}: rebuilt: {changes:?}"
        );
        assert_eq!(inode(&self.netns), self.inode, "{step}: same netns");
        assert_eq!(
            link_info(&self.netns, &self.tap).map(|l| l.1),
            Some(self.tap_index),
            "{step}: same tap"
        );
        assert!(
            driver.apply(plan).await.unwrap().is_empty(),
            "{step}: converged"
        );
        assert!(driver.drift(plan).await.unwrap().is_empty(), "{step}");
        let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
        let r = traffic::udp_echo(self.guest.netns(), echo, T)
            .unwrap_or_else(|e| panic!("{step}: guest → internet after the repair: {e}"));
        assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4), "{step}");
        // The relay counts a frame after writing it: the echo may be done before both counts.
        let deadline = std::time::Instant::now() + T;
        let mut after = self.guest.relay().stats();
        while (after.to_guest == before.to_guest || after.from_guest == before.from_guest)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
            after = self.guest.relay().stats();
        }
        assert!(
            after.to_guest > before.to_guest && after.from_guest > before.from_guest,
            "{step}: frames through the held tap: {before:?} → {after:?}"
        );
    }
}

fn plan_with(settings: &NsSettings, json: &str) -> VmPlan {
    plan_vm(&parse_vm_config(json.as_bytes()).unwrap(), settings).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn repairs_keep_the_netns_and_the_tap_a_vmm_holds() {
    let env = Env::new();
    let _echo = env.sb.start_echo().expect("echo");
    let uid = 0x2a;
    // Routes need a mesh address (no veth pair without one).
    let json = |mesh: Option<&str>| {
        let routes: &[(&str, &str)] = if mesh.is_some() {
            &[("0.0.0.0/0", "host")]
        } else {
            &[]
        };
        vm_json("held", uid, mesh, routes)
    };

    // A VM without a mesh address: a tap, no veth pair. The guest attaches to the tap.
    let bare = env.plan(&json(None));
    env.driver.apply(&bare).await.expect("create");
    let guest = env.guest("held", &bare, &[], 1380);
    let local = EchoService::start(
        &bare.netns,
        &[SocketAddr::new(IpAddr::V4(Ipv4Addr::new(172, 16, 0, 1)), 7)],
    )
    .unwrap();
    traffic::udp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(172, 16, 0, 1)), 7),
        T,
    )
    .expect("guest ↔ tap before any repair");
    drop(local);
    let held = Held {
        netns: bare.netns.clone(),
        tap: bare.tap.name.clone(),
        tap_index: link_info(&bare.netns, &bare.tap.name).unwrap().1,
        inode: inode(&bare.netns),
        guest,
    };
    let d = env.driver.as_ref();
    let is_add_veth = |c: &Change| c.to_string().starts_with("host: add veth");
    let is_repair = |c: &Change| matches!(c, Change::Repair { .. });

    // 1. A mesh address added: the veth pair joins the existing netns.
    let plan = env.plan(&json(Some("fdaa:9::2a")));
    held.repair(d, &plan, "mesh address added", is_add_veth)
        .await;
    let v = plan.veth.clone().unwrap();

    // 2. The veth pair deleted (deleting the host end takes the peer along).
    env.host_ip(&["link", "del", &v.host_name]);
    held.repair(d, &plan, "veth pair deleted", is_add_veth)
        .await;

    // 3. The netns end moved away: the host end is left without its peer.
    let stray = env.sb.add_netns("stray").unwrap();
    netns::ip(&plan.netns, &["link", "set", &v.peer_name, "netns", &stray]).unwrap();
    held.repair(d, &plan, "netns end gone", is_repair).await;

    // 4. The host end moved away: the netns end is left without its peer.
    env.host_ip(&["link", "set", &v.host_name, "netns", &stray]);
    held.repair(d, &plan, "host end gone", is_repair).await;

    // 5. The mesh address changed.
    let plan = env.plan(&json(Some("fdaa:9::99")));
    held.repair(d, &plan, "mesh address changed", |c| {
        matches!(c, Change::AddRoute(..))
    })
    .await;

    // 6. The tap's address changed by hand: the planned one comes back, the stray one goes.
    netns::ip(
        &plan.netns,
        &["addr", "del", "172.16.0.1/30", "dev", &plan.tap.name],
    )
    .unwrap();
    netns::ip(
        &plan.netns,
        &["addr", "add", "172.16.0.5/30", "dev", &plan.tap.name],
    )
    .unwrap();
    held.repair(d, &plan, "tap address changed", is_repair)
        .await;
    let addrs = netns::ip(&plan.netns, &["-4", "addr", "show", "dev", &plan.tap.name]).unwrap();
    assert!(
        addrs.contains("172.16.0.1/30") && !addrs.contains("172.16.0.5"),
        "{addrs}"
    );

    // 7. The MTU changed (the agent restarted with another --mtu).
    let mut mtu = env.settings.clone();
    mtu.mtu = 1400;
    let plan = plan_with(&mtu, &json(Some("fdaa:9::99")));
    held.repair(d, &plan, "mtu changed", is_repair).await;
    assert_eq!(link_info(&plan.netns, &plan.tap.name).unwrap().0, 1400);
    assert_eq!(link_info(&env.sb.host(), &v.host_name).unwrap().0, 1400);

    // 8. The transit range changed (another agent configuration on the same host): the veth
    // addresses are replaced in place and the host masquerades the new range.
    let mut transit = mtu.clone();
    transit.transit_ipv4 = "10.210.0.0/16".parse().unwrap();
    let other: Arc<dyn NsDriver> =
        Arc::new(NetlinkNsDriver::new(transit.clone(), Some(env.sb.host())).unwrap());
    let plan = plan_with(&transit, &json(Some("fdaa:9::99")));
    held.repair(other.as_ref(), &plan, "transit changed", is_repair)
        .await;
    let host4 = env.host_ip(&["-4", "addr", "show", "dev", &v.host_name]);
    assert!(
        host4.contains("10.210.0.169/30") && !host4.contains("10.200."),
        "{host4}"
    );

    // 9. The mesh address removed: the veth pair goes, the tap stays.
    let gone = plan_with(&transit, &json(None));
    let changes = other.apply(&gone).await.unwrap();
    assert!(
        changes
            .iter()
            .any(|c| c.to_string().starts_with("host: delete veth")),
        "{changes:?}"
    );
    assert!(link_info(&env.sb.host(), &v.host_name).is_none());
    assert_eq!(inode(&held.netns), held.inode);
    assert_eq!(link_info(&held.netns, &held.tap).unwrap().1, held.tap_index);
    assert!(other.drift(&gone).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_deleted_tap_is_made_again_inside_the_same_netns() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "t",
        0x2b,
        Some("fdaa:9::2b"),
        &[("0.0.0.0/0", "host")],
    ));
    env.driver.apply(&plan).await.unwrap();
    let ino = inode(&plan.netns);
    let v = plan.veth.clone().unwrap();
    let host_index = link_info(&env.sb.host(), &v.host_name).unwrap().1;
    netns::ip(&plan.netns, &["link", "del", &plan.tap.name]).unwrap();
    let drift = env.driver.drift(&plan).await.unwrap();
    assert!(
        drift.iter().any(|c| c.to_string().contains("tap")),
        "{drift:?}"
    );
    env.driver.apply(&plan).await.unwrap();
    assert_eq!(inode(&plan.netns), ino, "same netns");
    assert_eq!(
        link_info(&env.sb.host(), &v.host_name).unwrap().1,
        host_index,
        "veth kept"
    );
    assert!(link_info(&plan.netns, &plan.tap.name).is_some());
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    // The re-made tap carries traffic.
    let _echo = env.sb.start_echo().unwrap();
    let guest = env.guest("t", &plan, &[], 1380);
    let r = traffic::udp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("through the re-made tap");
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn drift_is_reported_and_repaired() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "d",
        0x71,
        Some("fdaa::71"),
        &[("0.0.0.0/0", "host")],
    ));
    // A crash between creating the mount point and mounting the namespace leaves a plain file.
    std::fs::write(format!("/run/netns/{}", plan.netns), b"").unwrap();
    let changes = env
        .driver
        .apply(&plan)
        .await
        .expect("apply over a half-made netns");
    assert!(
        matches!(changes.last(), Some(Change::CreateVm { .. })),
        "{changes:?}"
    );
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());

    // Hand edits: a route removed, the tap MTU changed, the nft table flushed.
    netns::ip(&plan.netns, &["route", "del", "0.0.0.0/0"]).unwrap();
    netns::ip(&plan.netns, &["link", "set", &plan.tap.name, "mtu", "1500"]).unwrap();
    netns::exec(&plan.netns, "nft", &["flush", "ruleset"], T).unwrap();
    let drift = env.driver.drift(&plan).await.unwrap();
    assert!(
        drift.iter().any(|c| matches!(c, Change::AddRoute(..))),
        "{drift:?}"
    );
    assert!(
        drift.iter().any(|c| matches!(c, Change::Repair { .. })),
        "{drift:?}"
    );
    assert!(
        drift.iter().any(|c| matches!(c, Change::ReplaceNft { .. })),
        "{drift:?}"
    );
    let fixed = env.driver.apply(&plan).await.unwrap();
    assert_eq!(
        fixed.len(),
        drift.len(),
        "apply made what drift reported: {fixed:?}"
    );
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    assert_eq!(link_info(&plan.netns, &plan.tap.name).unwrap().0, 1380);

    // The VM end made with the kernel's own link-locals on (`addrgenmode eui64`) and carrying
    // one: the mode is set back to `none` and the address removed, in place.
    let peer = plan.veth.as_ref().unwrap().peer_name.clone();
    netns::ip(&plan.netns, &["link", "set", &peer, "addrgenmode", "eui64"]).unwrap();
    netns::ip(
        &plan.netns,
        &["addr", "add", "fe80::402:ff:fe00:71/64", "dev", &peer],
    )
    .unwrap();
    let drift = env.driver.drift(&plan).await.unwrap();
    let said = format!("{drift:?}");
    assert!(
        said.contains(&format!("{peer} addrgenmode")) && said.contains("fe80::402:ff:fe00:71/64"),
        "{said}"
    );
    env.driver.apply(&plan).await.unwrap();
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    let addrs = netns::ip(&plan.netns, &["-6", "addr", "show", "dev", &peer]).unwrap();
    assert!(!addrs.contains("fe80::402:ff:fe00:71"), "{addrs}");
    let link = netns::ip(&plan.netns, &["-d", "link", "show", "dev", &peer]).unwrap();
    assert!(link.contains("addrgenmode none"), "{link}");

    // The host veth deleted by hand (its peer goes with it): the pair is made again in place,
    // the netns and its tap stay.
    let v = plan.veth.clone().unwrap();
    let tap_index = link_info(&plan.netns, &plan.tap.name).unwrap().1;
    env.host_ip(&["link", "del", &v.host_name]);
    let drift = env.driver.drift(&plan).await.unwrap();
    assert!(
        matches!(drift.as_slice(), [Change::AddVeth { .. }]),
        "{drift:?}"
    );
    let repaired = env.driver.apply(&plan).await.unwrap();
    assert!(
        matches!(repaired.first(), Some(Change::AddVeth { .. })),
        "{repaired:?}"
    );
    assert!(
        !repaired
            .iter()
            .any(|c| matches!(c, Change::CreateVm { .. } | Change::RemoveVm { .. })),
        "{repaired:?}"
    );
    assert_eq!(link_info(&plan.netns, &plan.tap.name).unwrap().1, tap_index);
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
}

/// The IPv6 echo from the guest to the fake internet through the veth, or `None`.
fn v6_echo(guest: &SimGuest, timeout: std::time::Duration) -> Option<IpAddr> {
    let to = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
    traffic::try_udp_echo(guest.netns(), to, timeout)
        .unwrap()
        .map(|r| r.peer.ip())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_veth_ends_reach_each_other_through_planned_neighbour_entries() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "n",
        0x74,
        Some("fdaa::74"),
        &[("0.0.0.0/0", "host"), ("::/0", "host")],
    ));
    env.driver.apply(&plan).await.unwrap();
    let _echo = env.sb.start_echo().unwrap();
    let guest = env.guest("n", &plan, &["::/0"], 1380);
    let v = plan.veth.clone().unwrap();
    let mesh = IpAddr::V6("fdaa::74".parse().unwrap());
    assert_eq!(v6_echo(&guest, T), Some(mesh), "guest ↔ internet over IPv6");

    // Each hand edit is drift, named; the apply repairs it in place and IPv6 passes again.
    let repair = |step: &'static str, want: String| {
        let d = env.driver.clone();
        let plan = plan.clone();
        async move {
            let drift = d.drift(&plan).await.unwrap();
            assert!(
                drift.iter().any(|c| c.to_string().contains(&want)),
                "{step}: {drift:?}"
            );
            let fixed = d.apply(&plan).await.unwrap();
            assert!(
                !fixed
                    .iter()
                    .any(|c| matches!(c, Change::CreateVm { .. } | Change::RemoveVm { .. })),
                "{step}: {fixed:?}"
            );
            assert!(d.drift(&plan).await.unwrap().is_empty(), "{step}");
        }
    };
    // 1. The netns's entry deleted: the host end answers no solicitation, so IPv6 stops.
    let gw = v.host_ipv6_link_local.addr().to_string();
    netns::ip(
        &plan.netns,
        &["-6", "neigh", "del", &gw, "dev", &v.peer_name],
    )
    .unwrap();
    assert_eq!(
        v6_echo(&guest, std::time::Duration::from_secs(2)),
        None,
        "without the netns's entry"
    );
    repair(
        "netns entry deleted",
        format!("{} neighbour {gw}", v.peer_name),
    )
    .await;
    assert_eq!(
        v6_echo(&guest, T),
        Some(mesh),
        "after the netns entry came back"
    );

    // 2. The host end taken down and up: the kernel flushed its permanent entry.
    env.host_ip(&["link", "set", &v.host_name, "down"]);
    env.host_ip(&["link", "set", &v.host_name, "up"]);
    repair(
        "host end down and up",
        format!("{} neighbour fe80::2", v.host_name),
    )
    .await;
    assert_eq!(v6_echo(&guest, T), Some(mesh), "after down and up");

    // 3. The host end's MAC changed: set back in place (the netns's entry names the planned one).
    env.host_ip(&["link", "set", &v.host_name, "address", "02:00:00:00:00:99"]);
    repair("host end mac changed", format!("{} mac", v.host_name)).await;
    let link = env.host_ip(&["link", "show", "dev", &v.host_name]);
    assert!(link.contains("link/ether 06:01:00:00:00:74"), "{link}");
    assert_eq!(v6_echo(&guest, T), Some(mesh), "after the MAC came back");

    // 4. The kernel's own link-local turned back on for the host end (as when the agent was
    // killed between making the pair and turning it off): turned off again.
    env.host_ip(&["link", "set", &v.host_name, "addrgenmode", "eui64"]);
    repair("addrgenmode eui64", format!("{} addrgenmode", v.host_name)).await;
    let link = env.host_ip(&["-d", "link", "show", "dev", &v.host_name]);
    assert!(link.contains("addrgenmode none"), "{link}");

    // 5. An IPv6 address added to the host end by hand: removed.
    env.host_ip(&[
        "-6",
        "addr",
        "add",
        "fe80::99/64",
        "dev",
        &v.host_name,
        "nodad",
    ]);
    repair(
        "address on the host end",
        "stale addresses fe80::99/64".into(),
    )
    .await;
    assert_eq!(
        env.host_ip(&["-6", "addr", "show", "dev", &v.host_name]),
        ""
    );
    assert_eq!(v6_echo(&guest, T), Some(mesh), "after the address went");

    // 6. IPv6 turned off on the host end (the kernel drops the VM's IPv6 there, and takes the
    // routes through it away), its own link-local back on too: IPv6 turned on again, after
    // `addrgenmode none`, so the end comes back without any IPv6 address.
    let off = |ns: &str, dev: &str, v: &str| {
        netns::sysctl(ns, &format!("net/ipv6/conf/{dev}/disable_ipv6"), v).unwrap();
    };
    off(&env.sb.host(), &v.host_name, "1");
    env.host_ip(&["link", "set", &v.host_name, "addrgenmode", "eui64"]);
    assert_eq!(v6_echo(&guest, std::time::Duration::from_secs(2)), None);
    repair("host end ipv6 off", format!("{} disable_ipv6", v.host_name)).await;
    assert_eq!(
        netns::sysctl_get(
            &env.sb.host(),
            &format!("net/ipv6/conf/{}/disable_ipv6", v.host_name)
        )
        .unwrap(),
        "0"
    );
    assert_eq!(
        env.host_ip(&["-6", "addr", "show", "dev", &v.host_name]),
        ""
    );
    assert_eq!(
        v6_echo(&guest, T),
        Some(mesh),
        "after the host end's IPv6 came back"
    );

    // 7. The same on the netns end: its planned link-local and entry go with it.
    off(&plan.netns, &v.peer_name, "1");
    assert_eq!(v6_echo(&guest, std::time::Duration::from_secs(2)), None);
    repair(
        "netns end ipv6 off",
        format!("{} disable_ipv6", v.peer_name),
    )
    .await;
    assert_eq!(
        v6_echo(&guest, T),
        Some(mesh),
        "after the netns end's IPv6 came back"
    );
}
