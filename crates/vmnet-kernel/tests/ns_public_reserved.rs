//! Public addresses the host's own network needs (root required): the trial's bug was a VM
//! given the uplink gateway's address as its `public_ipv4`, which the host then routed to the
//! VM, cutting every other VM's public traffic. The driver names the default route's gateway
//! and the network and broadcast addresses of the uplink subnet (IPv6: its subnet-router
//! anycast address) as reserved; any other address of the subnet (proxy mode hands those out)
//! and addresses beyond it are not.

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ns_support::Env;
use vmnet_kernel::ns::HostUse;
use vmnet_testkit::sandbox::{INET_UPLINK_V4, INET_UPLINK_V6};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_gateway_and_the_subnet_edges_are_reserved() {
    let env = Env::new();
    let reserved = async |a: IpAddr| match env.driver.host_use(&[a], None).await.unwrap() {
        Some((at, HostUse::Reserved(why))) => Some((at, why)),
        Some((at, HostUse::Own)) => Some((at, "own".to_owned())),
        None => None,
    };
    let (a, why) = reserved(IpAddr::V4(INET_UPLINK_V4))
        .await
        .expect("the gateway");
    assert_eq!(a, IpAddr::V4(INET_UPLINK_V4));
    assert!(why.contains("gateway of the host's default route"), "{why}");
    let net = reserved(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 0))).await;
    assert!(
        net.is_some_and(|(_, w)| w.contains("network address of the host's subnet 203.0.113.0/24"))
    );
    let bcast = reserved(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 255))).await;
    assert!(bcast.is_some_and(|(_, w)| w.contains("broadcast address")));
    let limited = reserved(IpAddr::V4(Ipv4Addr::BROADCAST)).await;
    assert!(limited.is_some_and(|(_, w)| w.contains("broadcast address")));
    let (_, why6) = reserved(IpAddr::V6(INET_UPLINK_V6))
        .await
        .expect("the IPv6 gateway");
    assert!(why6.contains("gateway"), "{why6}");
    let anycast = reserved(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 0))).await;
    assert!(anycast.is_some_and(|(_, w)| w.contains("subnet-router anycast")));
    // The host's own uplink address is its own, not reserved.
    assert_eq!(
        reserved(IpAddr::V4(vmnet_testkit::sandbox::HOST_UPLINK_V4)).await,
        Some((
            IpAddr::V4(vmnet_testkit::sandbox::HOST_UPLINK_V4),
            "own".to_owned()
        ))
    );
    for free in [
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, 57)),
        IpAddr::V4(Ipv4Addr::new(198, 51, 100, 9)),
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 0x57)),
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 7, 0, 0, 0, 0, 1)),
    ] {
        assert_eq!(reserved(free).await, None, "{free}");
    }
}
