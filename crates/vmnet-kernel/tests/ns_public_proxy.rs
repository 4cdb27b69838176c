//! Proxy ARP/NDP for public addresses (root required). The sandbox's public addresses here lie
//! on the uplink's own subnets (203.0.113.0/24, 2001:db8:0:1::/64), so the fake internet
//! resolves them with ARP/NDP on the link and the host must answer for them: with
//! `public_neighbors: proxy` it does and traffic arrives; without it (the control) nothing does.

mod ns_support;

use std::net::{IpAddr, SocketAddr};

use ns_support::{Env, T, v6};
use vmnet_plan::ns::{PublicNeighbors, VmPlan};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::sandbox::{HOST_UPLINK_IF, INET_UPLINK_V4, INET_UPLINK_V6};
use vmnet_testkit::traffic;

fn vm(env: &Env) -> VmPlan {
    env.plan(
        r#"{"id":"px","user_id":5,"tenant":1,"mesh_ipv6":"fdaa:1::5",
        "public_ipv4":"203.0.113.50","public_ipv6":"2001:db8:0:1::50",
        "network":{"routes":[{"destination":"0.0.0.0/0","via":"host"},{"destination":"::/0","via":"host"}]}}"#,
    )
}

fn proxies(env: &Env) -> String {
    env.host_ip(&["neigh", "show", "proxy"]) + &env.host_ip(&["-6", "neigh", "show", "proxy"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn proxy_mode_answers_arp_and_ndp_on_the_uplink_and_removal_takes_the_entries_away() {
    let env = Env::with(|s| {
        s.uplink = Some(HOST_UPLINK_IF.into());
        s.public_neighbors = PublicNeighbors::Proxy;
    });
    let plan = vm(&env);
    env.driver.apply(&plan).await.expect("apply");
    let p = proxies(&env);
    assert!(p.contains("203.0.113.50 dev uplink"), "{p}");
    assert!(p.contains("2001:db8:0:1::50 dev uplink"), "{p}");
    let g = env.guest("px", &plan, &["::/0"], 1380);
    let _svc = EchoService::start(
        g.netns(),
        &[
            SocketAddr::new("172.16.0.2".parse().unwrap(), 7),
            SocketAddr::new(IpAddr::V6(v6("fdaa:1::5")), 7),
        ],
    )
    .expect("guest echo");
    let inet = env.sb.inet();
    let r4 =
        traffic::tcp_echo(&inet, "203.0.113.50:7".parse().unwrap(), T).expect("v4 via proxy ARP");
    assert_eq!(r4.peer.ip(), IpAddr::V4(INET_UPLINK_V4));
    let r6 = traffic::tcp_echo(&inet, "[2001:db8:0:1::50]:7".parse().unwrap(), T)
        .expect("v6 via proxy NDP");
    assert_eq!(r6.peer.ip(), IpAddr::V6(INET_UPLINK_V6));
    assert_eq!(env.driver.apply(&plan).await.expect("re-apply"), vec![]);
    assert_eq!(env.driver.drift(&plan).await.expect("drift"), vec![]);

    // An entry deleted by hand is drift, repaired by the next apply.
    env.host_ip(&["neigh", "del", "proxy", "203.0.113.50", "dev", "uplink"]);
    let d = env.driver.drift(&plan).await.expect("drift");
    assert_eq!(d.len(), 1, "{d:?}");
    env.driver.apply(&plan).await.expect("repair");
    assert!(proxies(&env).contains("203.0.113.50 dev uplink"));

    env.driver.remove(5).await.expect("remove");
    let p = proxies(&env);
    assert!(
        !p.contains("203.0.113.50") && !p.contains("2001:db8:0:1::50"),
        "{p}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn control_without_proxy_mode_nothing_arrives() {
    let env = Env::new();
    let plan = vm(&env);
    env.driver.apply(&plan).await.expect("apply");
    let g = env.guest("px", &plan, &["::/0"], 1380);
    let _svc = EchoService::start(
        g.netns(),
        &[
            SocketAddr::new("172.16.0.2".parse().unwrap(), 7),
            SocketAddr::new(IpAddr::V6(v6("fdaa:1::5")), 7),
        ],
    )
    .expect("guest echo");
    let inet = env.sb.inet();
    let short = std::time::Duration::from_secs(2);
    assert!(
        traffic::try_tcp_echo(&inet, "203.0.113.50:7".parse().unwrap(), short)
            .unwrap()
            .is_none(),
        "no proxy ARP: nothing arrives"
    );
    assert!(
        traffic::try_tcp_echo(&inet, "[2001:db8:0:1::50]:7".parse().unwrap(), short)
            .unwrap()
            .is_none(),
        "no proxy NDP: nothing arrives"
    );
    assert!(proxies(&env).trim().is_empty());
}
