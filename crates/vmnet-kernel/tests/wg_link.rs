//! The mesh interface's link preparation (root required), on a stand-in link in a sandbox host
//! (the WireGuard device itself needs `wireguard-go`; the address handling is the same for any
//! link): the host's mesh address is added as a /128, and a changed mesh address replaces the
//! old one instead of joining it; addresses outside `fdaa::/16` are left alone. The mesh range
//! route is written when it is missing or differs, never when it is in place.

use vmnet_kernel::netns::netlink_in;
use vmnet_kernel::wg::link;
use vmnet_testkit::{Sandbox, netns};

fn addresses(sb: &Sandbox, dev: &str) -> Vec<String> {
    let out = netns::ip(
        &sb.host(),
        &["-6", "-o", "addr", "show", "dev", dev, "scope", "global"],
    )
    .expect("ip addr");
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .collect();
    v.sort();
    v
}

/// The link standing in for the WireGuard device in `sb`'s host: one end of a veth pair (this
/// kernel has no dummy links); its name.
fn stand_in(sb: &Sandbox) -> String {
    let dev = format!("{}m", sb.agent_prefix());
    let peer = format!("{}n", sb.agent_prefix());
    netns::ip(
        &sb.host(),
        &["link", "add", &dev, "type", "veth", "peer", "name", &peer],
    )
    .expect("stand-in link");
    dev
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_changed_mesh_address_replaces_the_old_one() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("wl").expect("sandbox");
    let dev = stand_in(&sb);
    netns::ip(
        &sb.host(),
        &["addr", "add", "2001:db8:5::1/128", "dev", &dev],
    )
    .expect("other");
    let h = netlink_in(&sb.host()).expect("netlink");
    let get = || async { link::by_name(&h, &dev).await.unwrap().expect("link") };

    link::prepare(&h, get().await, 1420, Some("fdaa::1".parse().unwrap()))
        .await
        .unwrap();
    assert_eq!(addresses(&sb, &dev), ["2001:db8:5::1/128", "fdaa::1/128"]);
    assert_eq!(get().await.mtu, 1420);
    assert!(get().await.up);

    // The same address again changes nothing; a new one replaces it.
    link::prepare(&h, get().await, 1420, Some("fdaa::1".parse().unwrap()))
        .await
        .unwrap();
    assert_eq!(addresses(&sb, &dev), ["2001:db8:5::1/128", "fdaa::1/128"]);
    link::prepare(&h, get().await, 1420, Some("fdaa::2".parse().unwrap()))
        .await
        .unwrap();
    assert_eq!(addresses(&sb, &dev), ["2001:db8:5::1/128", "fdaa::2/128"]);
}

/// The mesh range route lines of `ip -6 route show table main` in the sandbox host.
fn range_routes(sb: &Sandbox) -> Vec<String> {
    let out = netns::ip(&sb.host(), &["-6", "route", "show", "fdaa::/16"]).expect("ip route");
    out.lines().map(|l| l.trim().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_range_route_is_written_only_when_it_is_not_in_place() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("wr").expect("sandbox");
    let dev = stand_in(&sb);
    netns::ip(&sb.host(), &["link", "set", &dev, "up"]).expect("up");
    let h = netlink_in(&sb.host()).expect("netlink");
    let index = link::by_name(&h, &dev).await.unwrap().expect("link").index;
    // Every route change in the sandbox host while the calls run, as the kernel notifies it.
    let mut monitor = std::process::Command::new("ip")
        .args(["netns", "exec", &sb.host(), "ip", "-6", "monitor", "route"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ip monitor");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let ensure = || vmnet_kernel::mesh::route::ensure_range_route(&h, index, 1380);
    ensure().await.unwrap();
    ensure().await.unwrap();
    ensure().await.unwrap();
    let in_place = |r: Vec<String>| matches!(r.as_slice(), [l] if l.contains(&format!("dev {dev} ")) && l.contains("mtu lock 1380"));
    assert!(in_place(range_routes(&sb)), "{:?}", range_routes(&sb));
    // Changed by hand (another MTU): written again, once.
    netns::ip(
        &sb.host(),
        &[
            "-6",
            "route",
            "replace",
            "fdaa::/16",
            "dev",
            &dev,
            "mtu",
            "lock",
            "1400",
        ],
    )
    .expect("hand edit");
    ensure().await.unwrap();
    ensure().await.unwrap();
    assert!(in_place(range_routes(&sb)), "{:?}", range_routes(&sb));
    std::thread::sleep(std::time::Duration::from_millis(300));
    monitor.kill().unwrap();
    let out = monitor.wait_with_output().unwrap();
    let seen = String::from_utf8_lossy(&out.stdout);
    let writes = seen.lines().filter(|l| l.contains("fdaa::/16")).count();
    // The first call's add, the hand edit and the repair after it: nothing from the calls that
    // found the route in place.
    assert_eq!(writes, 3, "{seen}");
}
