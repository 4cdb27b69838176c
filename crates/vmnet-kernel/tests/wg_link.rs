//! The mesh interface's link preparation (root required), on a stand-in link in a sandbox host
//! (the WireGuard device itself needs `wireguard-go`; the address handling is the same for any
//! link): the host's mesh address is added as a /128, and a changed mesh address replaces the
//! old one instead of joining it; addresses outside `fdaa::/16` are left alone.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_changed_mesh_address_replaces_the_old_one() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("wl").expect("sandbox");
    let dev = format!("{}m", sb.agent_prefix());
    // A veth pair stands in (this kernel has no dummy links).
    let peer = format!("{}n", sb.agent_prefix());
    netns::ip(
        &sb.host(),
        &["link", "add", &dev, "type", "veth", "peer", "name", &peer],
    )
    .expect("stand-in link");
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
