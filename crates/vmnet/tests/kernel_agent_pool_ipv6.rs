//! Pool mode IPv6 through the real agent on a real kernel (root required): `vmnet serve
//! --netns <sandbox host> --host-id h1 --create-bridge`. A pool with a /29 and an IPv6 range,
//! two instances placed on h1 over the API: the NICs carry both leases and `gateway6`, the
//! bcd tables hold each tap's IPv6 lease, the seeds give both addresses and both default
//! routes; simulated guests configured from those seeds reach each other over IPv6 by their
//! leases, and not from an address the tap does not own.

mod agent_support;

use std::net::IpAddr;
use std::time::Duration;

use agent_support::start;
use serde_json::{Value, json};
use vmnet_agent::api::types::InstanceNics;
use vmnet_model::nic::{MacAddr, tap_name};
use vmnet_testkit::relay::Relay;
use vmnet_testkit::sim_guest;
use vmnet_testkit::{Sandbox, netns, require_root, traffic};

const T: Duration = Duration::from_secs(10);

/// The elements of set `name` in `bridge bcd_instances` inside `ns`, as JSON text each.
fn elements(ns: &str, name: &str) -> Vec<String> {
    let out = netns::exec(
        ns,
        "nft",
        &["-j", "list", "set", "bridge", "bcd_instances", name],
        T,
    )
    .unwrap();
    assert!(out.status.success(), "nft list set {name}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("set"))
        .flat_map(|s| s["elem"].as_array().cloned().unwrap_or_default())
        .map(|e| e.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: runs the agent in a sandbox namespace (scripts/test.sh runs it)"]
async fn the_agent_gives_guests_their_ipv6_leases() {
    require_root();
    let sb = Sandbox::new("kv").expect("sandbox");
    let host = sb.host();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let opts = agent_support::options(&sb, &dir, 2).args([
        "--host-id",
        "h1",
        "--bridge",
        "br0",
        "--create-bridge",
    ]);
    let mut agent = start(&opts).await;
    let client = agent.client().clone();
    let _: Value = client
        .put(
            "/v1/pools/p1/range",
            &json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["10.0.0.1"]}),
        )
        .await
        .unwrap();
    let _: Value = client
        .post(
            "/v1/pools/p1/ranges",
            Some(
                &json!({"cidr": "2001:db8:10::/64", "gateway": "2001:db8:10::1",
                         "first_host": "2001:db8:10::2", "last_host": "2001:db8:10::6"}),
            ),
        )
        .await
        .unwrap();
    let _: Value = client
        .put("/v1/hosts/h1", &json!({"vcpus": 8, "memory_mib": 8192}))
        .await
        .unwrap();
    let seeds = dir.join("state/pool/seeds");
    let mut guests = Vec::new();
    let mut relays = Vec::new();
    for (id, v4, v6) in [
        ("i-a", "10.0.0.2", "2001:db8:10::2"),
        ("i-b", "10.0.0.3", "2001:db8:10::3"),
    ] {
        let inst: Value = client
            .post(
                "/v1/instances",
                Some(&json!({"instance_id": id, "pool_id": "p1", "host_id": "h1",
                             "vcpus": 1, "memory_mib": 256})),
            )
            .await
            .unwrap();
        assert_eq!(
            (inst["address"].as_str(), inst["address6"].as_str()),
            (Some(v4), Some(v6))
        );
        let tap = tap_name(id, 0).unwrap().to_string();
        // The NIC: both leases, both gateways.
        let nics: InstanceNics = client
            .get(&format!("/v1/instances/{id}/nics"))
            .await
            .unwrap();
        assert!(nics.realised);
        let nic = &nics.nics[0];
        assert_eq!(nic.addresses, [format!("{v4}/29"), format!("{v6}/64")]);
        assert_eq!(
            (nic.gateway.as_deref(), nic.gateway6.as_deref()),
            (Some("10.0.0.1"), Some("2001:db8:10::1"))
        );
        // The tables: the tap's IPv6 lease is an allowed source.
        assert!(
            elements(&host, "tap_ip6")
                .iter()
                .any(|e| e.contains(&tap) && e.contains(v6)),
            "tap_ip6 holds {tap} {v6}: {:?}",
            elements(&host, "tap_ip6")
        );
        // The seed: both addresses, the IPv4 route and gateway6.
        let nc = std::fs::read_to_string(seeds.join(id).join("network-config")).unwrap();
        let eth0 = serde_json::from_str::<Value>(&nc).unwrap()["ethernets"]["eth0"].clone();
        assert_eq!(
            eth0["addresses"],
            json!([format!("{v4}/29"), format!("{v6}/64")])
        );
        assert_eq!(eth0["gateway6"], "2001:db8:10::1");
        // A simulated guest on the tap the agent made, configured from that seed.
        let ns = sb.add_netns(&format!("g{id}")).unwrap();
        netns::sysctl(&ns, "net/ipv6/conf/all/accept_dad", "0").unwrap();
        netns::sysctl(&ns, "net/ipv6/conf/default/accept_dad", "0").unwrap();
        relays.push(Relay::start(&host, &tap, &ns, "eth0").unwrap());
        let net = sim_guest::configure(&ns, "eth0", MacAddr::for_instance(id), Some(&nc)).unwrap();
        assert_eq!(net.addresses, [format!("{v4}/29"), format!("{v6}/64")]);
        guests.push(ns);
    }
    std::thread::sleep(Duration::from_millis(300));
    let to_b: IpAddr = "2001:db8:10::3".parse().unwrap();
    let reaches = |ns: &str| {
        traffic::ping(ns, to_b, 3, Duration::from_millis(400))
            .unwrap()
            .received
            > 0
    };
    assert!(
        reaches(&guests[0]),
        "guest a reaches guest b by its IPv6 lease"
    );
    // Guest a takes an address of the range it does not hold: dropped.
    let a = &guests[0];
    netns::ip(
        a,
        &["-6", "addr", "del", "2001:db8:10::2/64", "dev", "eth0"],
    )
    .unwrap();
    netns::ip(
        a,
        &[
            "-6",
            "addr",
            "add",
            "2001:db8:10::5/64",
            "dev",
            "eth0",
            "nodad",
        ],
    )
    .unwrap();
    assert!(!reaches(a), "a foreign IPv6 source is dropped");
    netns::ip(
        a,
        &["-6", "addr", "del", "2001:db8:10::5/64", "dev", "eth0"],
    )
    .unwrap();
    netns::ip(
        a,
        &[
            "-6",
            "addr",
            "add",
            "2001:db8:10::2/64",
            "dev",
            "eth0",
            "nodad",
        ],
    )
    .unwrap();
    assert!(reaches(a), "with its lease again guest a reaches guest b");
    drop(relays);
    let status = agent.sigterm().expect("SIGTERM the agent");
    assert!(
        status.success(),
        "agent exit {status:?}; {}",
        agent.log_text()
    );
    drop(sb);
}
