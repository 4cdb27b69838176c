//! Router advertisements on the uplink survive the forwarding the driver turns on (root
//! required): a sandbox host that gets its default IPv6 route from the fake internet's router by
//! SLAAC keeps it after the driver enabled IPv6 forwarding — at once and beyond the router
//! lifetime, so advertisements are still processed — because the uplink gets `accept_ra=2`;
//! no other link changes, and an uplink put back to `accept_ra=1` is repaired as host drift.
//! Everything happens in the sandbox host namespace.

mod ns_support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ns_support::{Env, vm_json};
use vmnet_kernel::ns::{Change, NetlinkNsDriver, NsDriver};
use vmnet_testkit::netns;
use vmnet_testkit::ra::{Advert, RouterAdvertiser};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V6, HOST_UPLINK_IF, INET_UPLINK_IF};
use vmnet_testkit::traffic;

/// The sandbox host's default IPv6 routes learned from advertisements.
fn ra_defaults(host: &str) -> Vec<String> {
    netns::ip(host, &["-6", "route", "show", "default"])
        .unwrap()
        .lines()
        .filter(|l| l.contains("proto ra"))
        .map(str::to_owned)
        .collect()
}

/// Whether the sandbox host reaches the fake internet's echo service over IPv6 (through its
/// default route: the only one, learned by SLAAC; an expired route is not used).
fn reaches_v6(host: &str) -> bool {
    let echo = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
    traffic::try_udp_echo(host, echo, Duration::from_millis(500))
        .unwrap()
        .is_some()
}

fn sysctl(ns: &str, key: &str) -> String {
    netns::sysctl_get(ns, key).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_uplink_keeps_its_slaac_default_route_after_forwarding_is_enabled() {
    // Env makes the driver at once; it touches the host only at its first apply.
    let env = Env::new();
    let host = env.sb.host();
    let uplink_ra = format!("net/ipv6/conf/{HOST_UPLINK_IF}/accept_ra");
    // A host as it boots: forwarding off, its default IPv6 route from advertisements only.
    netns::sysctl(&host, "net/ipv6/conf/all/forwarding", "0").unwrap();
    netns::ip(&host, &["-6", "route", "del", "default"]).unwrap();
    assert_eq!(sysctl(&host, &uplink_ra), "1");
    let lifetime = 4;
    let router = RouterAdvertiser::start(
        &env.sb.inet(),
        INET_UPLINK_IF,
        Advert {
            router_lifetime: lifetime,
            prefix: "2001:db8:0:1::".parse().unwrap(),
            prefix_lifetime: 600,
            interval: Duration::from_secs(1),
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ra_defaults(&host).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !ra_defaults(&host).is_empty(),
        "the host learns its default route by SLAAC ({} adverts sent, last error {:?})",
        router.sent(),
        router.last_error()
    );

    // The driver enables forwarding (its first apply sets up the host).
    let plan = env.plan(&vm_json("r", 0x3a, Some("fdaa:3::3a"), &[("::/0", "host")]));
    env.driver.apply(&plan).await.expect("apply");
    assert_eq!(sysctl(&host, "net/ipv6/conf/all/forwarding"), "1");
    assert!(!ra_defaults(&host).is_empty(), "not purged by forwarding");
    assert_eq!(
        sysctl(&host, &uplink_ra),
        "2",
        "the uplink keeps processing adverts"
    );
    // Past the router lifetime the route still works: new adverts refresh it.
    let _echo = env.sb.start_echo().unwrap();
    std::thread::sleep(Duration::from_secs(u64::from(lifetime) + 2));
    assert!(!ra_defaults(&host).is_empty());
    assert!(
        reaches_v6(&host),
        "the SLAAC default route outlives its lifetime with forwarding on"
    );

    // Only the uplink was changed: the VM's host veth keeps the default.
    let veth = &plan.veth.as_ref().unwrap().host_name;
    assert_eq!(
        sysctl(&host, &format!("net/ipv6/conf/{veth}/accept_ra")),
        "1"
    );
    assert!(
        env.driver.repair_host().await.unwrap().is_empty(),
        "in sync"
    );

    // The uplink put back to accept_ra=1: advertisements are ignored again and the learned
    // route expires. That is host drift, found even by a driver that never saw the route (a
    // restarted agent): the uplink still has its SLAAC address.
    netns::sysctl(&host, &uplink_ra, "1").unwrap();
    std::thread::sleep(Duration::from_secs(u64::from(lifetime) + 1));
    assert!(!reaches_v6(&host), "ignored adverts: the route expired");
    let restarted = NetlinkNsDriver::new(env.settings.clone(), Some(host.clone())).unwrap();
    let fixed = restarted.repair_host().await.unwrap();
    assert!(
        matches!(fixed.as_slice(), [Change::Repair { what }] if what.contains(HOST_UPLINK_IF)),
        "{fixed:?}"
    );
    assert_eq!(sysctl(&host, &uplink_ra), "2");
    let deadline = Instant::now() + Duration::from_secs(3);
    while !reaches_v6(&host) && Instant::now() < deadline {}
    assert!(reaches_v6(&host), "the next advert brings the route back");
    assert!(restarted.repair_host().await.unwrap().is_empty(), "in sync");
}
