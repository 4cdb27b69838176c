//! The test kit's own tests, in throwaway namespaces: the sandbox uplink and echo service, the
//! frame relay between two taps, and cleanup on drop and on panic.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use vmnet_testkit::guest::{GATEWAY_V4, GUEST_MAC, GUEST_V4, GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4, HOST_UPLINK_V6};
use vmnet_testkit::{Sandbox, netns, require_root, sandbox, traffic};

const T: Duration = Duration::from_secs(3);

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn sandbox_uplink_reaches_echo_service_and_cleans_up() {
    require_root();
    let sb = Sandbox::new("kt").expect("sandbox");
    let prefix = sb.prefix().to_owned();
    assert_eq!(
        netns::sysctl_get(&sb.host(), "net/ipv4/ip_forward").expect("sysctl"),
        "1"
    );
    assert_eq!(
        netns::sysctl_get(&sb.inet(), "net/ipv4/ip_forward").expect("sysctl"),
        "0"
    );
    let _echo = sb.start_echo().expect("echo");

    let v4 = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    let v6 = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
    let r = traffic::tcp_echo(&sb.host(), v4, T).expect("tcp v4");
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));
    // The sandbox host's uplink has MTU 1500: MSS 1460.
    assert_eq!(r.syn_mss, Some(1460));
    let r = traffic::tcp_echo(&sb.host(), v6, T).expect("tcp v6");
    assert_eq!(r.peer.ip(), IpAddr::V6(HOST_UPLINK_V6));
    assert_eq!(r.syn_mss, Some(1440));
    let r = traffic::udp_echo(&sb.host(), v4, T).expect("udp v4");
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));
    let r = traffic::udp_echo(&sb.host(), v6, T).expect("udp v6");
    assert_eq!(r.peer.ip(), IpAddr::V6(HOST_UPLINK_V6));
    let seen = _echo.seen();
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert!(
        seen.iter()
            .any(|s| !s.tcp && s.peer.ip() == IpAddr::V6(HOST_UPLINK_V6) && s.local == v6)
    );
    let p = traffic::ping(&sb.host(), IpAddr::V4(ECHO_V4), 2, T).expect("ping");
    assert_eq!((p.sent, p.received), (2, 2));
    let p = traffic::ping(&sb.host(), IpAddr::V6(ECHO_V6), 2, T).expect("ping6");
    assert_eq!((p.sent, p.received), (2, 2));

    // Nothing listens on port 9: refused at once, never hangs.
    let start = Instant::now();
    let none = traffic::try_tcp_echo(&sb.host(), SocketAddr::new(IpAddr::V4(ECHO_V4), 9), T)
        .expect("check");
    assert!(none.is_none());
    assert!(start.elapsed() < T);

    // Closures with a time limit: a result in time, a timeout otherwise, never a hang.
    let v = netns::run_in_timeout(&sb.host(), T, || 42).expect("in time");
    assert_eq!(v, 42);
    let slow = netns::run_in_timeout(&sb.host(), Duration::from_millis(50), || {
        std::thread::sleep(Duration::from_millis(500));
    });
    assert!(
        matches!(slow, Err(vmnet_testkit::SandboxError::Timeout { .. })),
        "{slow:?}"
    );
    assert!(netns::run_in_timeout("no-such-netns-kt", T, || ()).is_err());

    let extra = sb.add_netns("extra").expect("extra netns");
    assert!(extra.starts_with(&prefix));
    assert_eq!(sb.agent_prefix(), prefix);
    assert!(
        prefix.len() <= 10
            && prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    );
    drop(_echo);
    drop(sb);
    assert_eq!(sandbox::leftovers(&prefix), Vec::<String>::new());
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn relay_joins_a_persistent_tap_to_a_guest() {
    require_root();
    let sb = Sandbox::new("kt").expect("sandbox");
    // A "VM namespace" with a persistent tap, as the agent makes it.
    let vm = sb.add_netns("vm").expect("vm netns");
    netns::ip(&vm, &["tuntap", "add", "dev", "tapvm", "mode", "tap"]).expect("tap");
    netns::ip(&vm, &["addr", "add", "172.16.0.1/30", "dev", "tapvm"]).expect("addr");
    netns::ip(
        &vm,
        &["-6", "addr", "add", "fd00::1/128", "dev", "tapvm", "nodad"],
    )
    .expect("addr6");
    netns::ip(&vm, &["link", "set", "tapvm", "up"]).expect("up");
    netns::ip(
        &vm,
        &["-6", "route", "add", "fdaa:1::2/128", "dev", "tapvm"],
    )
    .expect("route6");
    let mesh: Ipv6Addr = "fdaa:1::2".parse().expect("mesh");
    let cfg = GuestConfig {
        mesh_ipv6: Some(mesh),
        routes_v6: vec![GuestRoute6 {
            destination: "fd00::1/128".into(),
            via: None,
        }],
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach(&sb, "a", &vm, "tapvm", &cfg).expect("guest");
    let link = netns::ip(guest.netns(), &["link", "show", "eth0"]).expect("link");
    assert!(
        link.contains(GUEST_MAC) && link.contains("mtu 1380"),
        "{link}"
    );

    let p = traffic::ping(guest.netns(), IpAddr::V4(GATEWAY_V4), 3, T).expect("ping");
    assert_eq!(p.received, 3, "guest -> gateway over the relay");
    let p = traffic::ping(guest.netns(), "fd00::1".parse().expect("ip"), 2, T).expect("ping6");
    assert_eq!(p.received, 2, "guest -> vm netns over IPv6");

    // TCP through the relay; the far end sees the guest and the SYN MSS of a 1380 MTU.
    let _echo =
        vmnet_testkit::echo::EchoService::start(&vm, &[SocketAddr::new(IpAddr::V4(GATEWAY_V4), 7)])
            .expect("echo");
    let r = traffic::tcp_echo(guest.netns(), SocketAddr::new(IpAddr::V4(GATEWAY_V4), 7), T)
        .expect("tcp");
    assert_eq!(r.peer.ip(), IpAddr::V4(GUEST_V4));
    assert_eq!(r.syn_mss, Some(1340));
    let s = guest.relay().stats();
    assert!(s.to_guest > 0 && s.from_guest > 0, "{s:?}");

    // No route beyond the VM namespace: no reach, quickly.
    let none = traffic::try_tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), 7),
        Duration::from_secs(1),
    )
    .expect("check");
    assert!(none.is_none());

    // Dropping the relay removes the guest's eth0 but keeps the VM's persistent tap.
    let gns = guest.netns().to_owned();
    drop(guest);
    assert!(netns::ip(&gns, &["link", "show", "eth0"]).is_err());
    assert!(netns::ip(&vm, &["link", "show", "tapvm"]).is_ok());
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn attaching_to_a_missing_tap_fails_without_creating_one() {
    require_root();
    let sb = Sandbox::new("kt").expect("sandbox");
    let vm = sb.add_netns("vm").expect("vm");
    let err = vmnet_testkit::tap::open_existing_tap(&vm, "nosuchtap").expect_err("must fail");
    assert!(err.to_string().contains("nosuchtap"), "{err}");
    assert!(netns::ip(&vm, &["link", "show", "nosuchtap"]).is_err());
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn sandbox_is_removed_when_a_test_panics() {
    require_root();
    let prefix = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let sb = Sandbox::new("kt").expect("sandbox");
        *prefix.lock().expect("lock") = sb.prefix().to_owned();
        sb.add_netns("doomed").expect("extra");
        panic!("deliberate");
    });
    assert!(result.is_err());
    let prefix = prefix.into_inner().expect("lock");
    assert!(!prefix.is_empty());
    assert_eq!(sandbox::leftovers(&prefix), Vec::<String>::new());
}

#[test]
fn generated_prefixes_are_prefix_free() {
    let a = sandbox::unique_prefix("a");
    let b = sandbox::unique_prefix("ab");
    let c = sandbox::unique_prefix("a");
    for (x, y) in [(&a, &b), (&a, &c), (&b, &c)] {
        assert!(
            !x.starts_with(y.as_str()) && !y.starts_with(x.as_str()),
            "{x} {y}"
        );
    }
    assert_eq!(a.len(), 9);
    assert_eq!(b.len(), 10);
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn kept_sandbox_survives_until_cleanup() {
    require_root();
    let sb = Sandbox::new("kt").expect("sandbox");
    let host = sb.host();
    let prefix = sb.keep();
    assert!(netns::exists(&host));
    sandbox::cleanup(&prefix).expect("cleanup");
    assert_eq!(sandbox::leftovers(&prefix), Vec::<String>::new());
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn cleanup_never_touches_a_sandbox_whose_prefix_only_starts_with_ours() {
    require_root();
    let short = sandbox::unique_prefix("kp");
    let long = format!("{short}x");
    // Guards first, so a failure below still removes both (each only its own).
    let _short_guard = Sandbox::adopt(&short);
    let long_sb = Sandbox::with_prefix(&long).expect("long sandbox");
    let mine = format!("{short}n0001");
    netns::create(&mine).expect("derived netns");

    // Neither can be made while the other exists: prefixes stay prefix-free.
    let err = Sandbox::with_prefix(&short).expect_err("prefix of a live sandbox");
    assert!(err.to_string().contains(&format!("{long}host")), "{err}");
    assert!(!sandbox::prefix_conflicts(&format!("{long}y")).is_empty());

    assert_eq!(sandbox::owned(&short), vec![mine.clone()]);
    sandbox::cleanup(&short).expect("cleanup");
    assert!(!netns::exists(&mine));
    assert_eq!(
        sandbox::owned(&long),
        vec![format!("{long}host"), format!("{long}inet")],
        "the longer sandbox survives"
    );
    drop(long_sb);
    assert_eq!(sandbox::leftovers(&long), Vec::<String>::new());
    assert!(sandbox::prefix_conflicts(&short).is_empty());
}
