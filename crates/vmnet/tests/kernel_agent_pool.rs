//! Pool mode through the real agent on a real kernel (root required): `vmnet serve --netns
//! <sandbox host> --host-id h1 --create-bridge` in a throwaway sandbox. Over the API a /29 pool,
//! host h1 and two instances; then, inside the sandbox only: the taps are on the bridge with the
//! instances' MACs, the bcd set elements hold them, the seeds carry the leases, the status shows
//! the tables; a killed and restarted agent reuses the taps of the instances still placed and
//! collects the others; simulated guests on two taps reach each other, not with a spoofed
//! source; `nft flush ruleset` is repaired by the audit and counted; deleting an instance
//! removes its tap and elements; deleting the last removes the backstop tables.

mod agent_support;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agent_support::{VMNET, sigkill, start};
use serde_json::{Value, json};
use vmnet_agent::api::types::{AgentStatus, InstanceNics, PoolStatus};
use vmnet_agent::client::Client;
use vmnet_model::nic::{MacAddr, tap_name};
use vmnet_testkit::agent::AgentOptions;
use vmnet_testkit::relay::Relay;
use vmnet_testkit::sim_guest;
use vmnet_testkit::{Sandbox, netns, require_root, traffic};

const T: Duration = Duration::from_secs(10);

/// `vmnet` and `vmnetd` alone in a directory of their own (hard links, or copies across file
/// systems), so no `vmnet-pool-helper` sits next to them and the agent runs itself as the root
/// helper (`vmnetd serve --pool-helper-serve`), as an installed `vmnet` without the helper
/// binary does.
fn lone_vmnet() -> (tempfile::TempDir, PathBuf) {
    let target = Path::new(VMNET).parent().unwrap().parent().unwrap();
    let d = tempfile::Builder::new()
        .prefix("vmnet-lone-")
        .tempdir_in(target)
        .unwrap();
    for name in ["vmnet", "vmnetd"] {
        let from = Path::new(VMNET).with_file_name(name);
        let to = d.path().join(name);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).unwrap();
        }
    }
    let exe = d.path().join("vmnet");
    (d, exe)
}

/// The pool agent of these tests: host h1 on bridge `br0` (created by the agent), reconcile
/// every 2 s, run from `vmnet` (the lone copy).
fn pool_agent(vmnet: &Path, sb: &Sandbox, dir: &Path) -> AgentOptions {
    agent_support::options(sb, dir, 2).exe(vmnet).args([
        "--host-id",
        "h1",
        "--bridge",
        "br0",
        "--create-bridge",
    ])
}

/// `nft -j list ruleset` inside the sandbox host.
fn ruleset(ns: &str) -> Value {
    let out = netns::exec(ns, "nft", &["-j", "list", "ruleset"], T).unwrap();
    assert!(out.status.success(), "nft list ruleset failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Owned tables present, as `family name`.
fn tables(rs: &Value) -> Vec<String> {
    let mut t: Vec<String> = rs["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("table"))
        .filter(|t| t["name"].as_str().is_some_and(|n| n.starts_with("bcd_")))
        .map(|t| {
            format!(
                "{} {}",
                t["family"].as_str().unwrap(),
                t["name"].as_str().unwrap()
            )
        })
        .collect();
    t.sort();
    t
}

/// The elements of set `name` in `bridge bcd_instances`, as JSON text each.
fn elements(rs: &Value, name: &str) -> Vec<String> {
    rs["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("set").or_else(|| o.get("map")))
        .filter(|s| s["table"] == "bcd_instances" && s["name"] == name)
        .flat_map(|s| s["elem"].as_array().cloned().unwrap_or_default())
        .map(|e| e.to_string())
        .collect()
}

/// `ip -j link show dev NAME` inside the sandbox, if the link exists.
fn link(ns: &str, name: &str) -> Option<Value> {
    let out = Command::new("ip")
        .args(["-n", ns, "-d", "-j", "link", "show", "dev", name])
        .output()
        .unwrap();
    if !out.status.success() {
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.as_array()?.first().cloned()
}

/// The `bc*` links in the sandbox host, sorted.
fn bc_links(ns: &str) -> Vec<String> {
    let mut l: Vec<String> = agent_support::links(ns)
        .into_iter()
        .filter(|l| l.starts_with("bc"))
        .collect();
    l.sort();
    l
}

async fn pool_status(client: &Client) -> PoolStatus {
    let st: AgentStatus = client.get("/v1/status").await.unwrap();
    st.pool.expect("pool mode is on")
}

/// Whether a child process of `parent` runs with `needle` in its command line.
fn has_child(parent: u32, needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        let p = e.path();
        let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
        let ppid_ok = status
            .lines()
            .any(|l| l.strip_prefix("PPid:").map(str::trim) == Some(&parent.to_string()));
        ppid_ok
            && std::fs::read(p.join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn agent_realises_pool_instances_repairs_drift_and_cleans_up() {
    require_root();
    let sb = Sandbox::new("kp").expect("sandbox");
    let host = sb.host();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let (_lone, vmnet) = lone_vmnet();
    let mut agent = start(&pool_agent(&vmnet, &sb, &dir)).await;
    let client = agent.client().clone();

    // Started: the bridge exists, the root helper is a child process, the instances table is
    // loaded and the backstop is not (no NIC yet).
    let br = link(&host, "br0").expect("bridge br0 created in the sandbox");
    assert_eq!(br["linkinfo"]["info_kind"], "bridge", "{br}");
    assert!(
        has_child(agent.pid(), "--pool-helper-serve"),
        "root helper runs"
    );
    assert_eq!(tables(&ruleset(&host)), ["bridge bcd_instances"]);
    assert_eq!(pool_status(&client).await.tables, ["bridge bcd_instances"]);

    // A /29 pool, host h1, two instances on it.
    let _: Value = client
        .put(
            "/v1/pools/p1/range",
            &json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["10.0.0.1"]}),
        )
        .await
        .unwrap();
    let _: Value = client
        .put("/v1/hosts/h1", &json!({"vcpus": 8, "memory_mib": 8192}))
        .await
        .unwrap();
    let mut leases = Vec::new();
    for id in ["i-a", "i-b"] {
        let t = Instant::now();
        let inst: Value = client
            .post(
                "/v1/instances",
                Some(&json!({"instance_id": id, "pool_id": "p1", "host_id": "h1", "vcpus": 1, "memory_mib": 256})),
            )
            .await
            .unwrap();
        // The answer comes after this host converged: lease, rules, tap and seed (one run's
        // time is printed for the record; first instance = full replace of the three tables).
        eprintln!("create {id} with its NIC realised: {:?}", t.elapsed());
        leases.push(inst["address"].as_str().unwrap().to_owned());
    }
    assert_eq!(leases, ["10.0.0.2", "10.0.0.3"]);

    let seeds = dir.join("state/pool/seeds");
    let rs = ruleset(&host);
    for (id, lease) in [("i-a", "10.0.0.2"), ("i-b", "10.0.0.3")] {
        let tap = tap_name(id, 0).unwrap().to_string();
        let mac = MacAddr::for_instance(id).to_string();
        // The tap, on the bridge, with the instance's MAC in its static FDB entry and up.
        let l =
            link(&host, &tap).unwrap_or_else(|| panic!("tap {tap} missing; {}", agent.log_text()));
        assert_eq!(l["master"], "br0", "{l}");
        assert!(
            l["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
            "{l}"
        );
        let fdb = netns::exec(&host, "bridge", &["fdb", "show", "dev", &tap], T).unwrap();
        assert!(
            String::from_utf8_lossy(&fdb.stdout).contains(&mac),
            "fdb of {tap}: {}",
            String::from_utf8_lossy(&fdb.stdout)
        );
        // Set elements for the tap: the tap, its MAC, its lease.
        assert!(
            elements(&rs, "taps").iter().any(|e| e.contains(&tap)),
            "taps set"
        );
        assert!(
            elements(&rs, "tap_mac")
                .iter()
                .any(|e| e.contains(&tap) && e.contains(&mac)),
            "tap_mac set"
        );
        assert!(
            elements(&rs, "tap_ip4")
                .iter()
                .any(|e| e.contains(&tap) && e.contains(lease)),
            "tap_ip4 set"
        );
        // The seed carries the lease.
        let nc = std::fs::read_to_string(seeds.join(id).join("network-config")).unwrap();
        let nc: Value = serde_json::from_str(&nc).unwrap();
        assert_eq!(
            nc["ethernets"]["eth0"]["addresses"],
            json!([format!("{lease}/29")])
        );
        assert_eq!(nc["ethernets"]["eth0"]["match"]["macaddress"], mac);
        if vmnet_agent::pool::seeds::image_tool_available() {
            assert!(seeds.join(id).join("seed.iso").is_file(), "cidata image");
        }
        // The NICs over the API.
        let nics: InstanceNics = client
            .get(&format!("/v1/instances/{id}/nics"))
            .await
            .unwrap();
        assert!(nics.realised);
        assert_eq!(nics.nics[0].tap, tap);
        assert_eq!(nics.nics[0].mac, mac);
        assert_eq!(nics.nics[0].addresses, [format!("{lease}/29")]);
        assert_eq!(nics.nics[0].gateway.as_deref(), Some("10.0.0.1"));
    }
    assert_eq!(
        tables(&rs),
        ["arp bcd_taps", "bridge bcd_instances", "inet bcd_taps"]
    );
    let st = pool_status(&client).await;
    assert_eq!(st.tables, tables(&rs));
    assert_eq!(st.instances, 2);
    assert_eq!(st.elements.get("bridge bcd_instances taps"), Some(&2));
    assert!(st.rules.get("inet bcd_taps").is_some_and(|n| *n > 0));
    assert!(st.last_errors.is_empty(), "{:?}", st.last_errors);
    let (ok, out, err) = agent_support::run_cli(&dir, &["status"]);
    assert!(ok, "vmnet status: {err}");
    assert!(
        out.contains("pool tables") && out.contains("inet bcd_taps") && out.contains("2 realised"),
        "{out}"
    );

    // The agent is killed; while it is down i-b is deleted and i-c created in the store. The
    // restarted agent reuses i-a's tap (same ifindex), collects i-b's and makes i-c's.
    let tap_a = tap_name("i-a", 0).unwrap().to_string();
    let tap_b = tap_name("i-b", 0).unwrap().to_string();
    let tap_c = tap_name("i-c", 0).unwrap().to_string();
    let ifindex_a = link(&host, &tap_a).unwrap()["ifindex"].clone();
    sigkill(&mut agent);
    let db = format!("sqlite://{}", dir.join("vmnet.db").display());
    for args in [
        vec!["instance", "delete", "i-b"],
        vec!["instance", "create", "i-c", "--pool", "p1", "--host", "h1"],
    ] {
        let out = Command::new(VMNET)
            .args(["--database-url", &db])
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut agent = start(&pool_agent(&vmnet, &sb, &dir)).await;
    let t = Instant::now();
    let st = loop {
        let st = pool_status(&client).await;
        if st.passes > 0 && st.instances == 2 {
            break st;
        }
        assert!(
            t.elapsed() < T,
            "no pass after restart: {st:?}; {}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(st.last_errors.is_empty(), "{:?}", st.last_errors);
    let mut want = vec![tap_a.clone(), tap_c.clone()];
    want.sort();
    assert_eq!(bc_links(&host), want);
    assert_eq!(
        link(&host, &tap_a).unwrap()["ifindex"],
        ifindex_a,
        "tap reused"
    );
    let rs = ruleset(&host);
    assert!(
        elements(&rs, "tap_ip4")
            .iter()
            .any(|e| e.contains(&tap_c) && e.contains("10.0.0.3"))
    );
    assert!(!elements(&rs, "taps").iter().any(|e| e.contains(&tap_b)));
    assert!(!seeds.join("i-b").exists() && seeds.join("i-c/network-config").is_file());
    // Every collection is logged with the object and the reason.
    let logged = agent.log_text();
    for (what, name) in [
        ("pool: deleted a stray tap", tap_b.as_str()),
        ("pool: removed a seed", "i-b"),
    ] {
        assert!(
            logged
                .lines()
                .any(|l| l.contains(what) && l.contains(name) && l.contains("reason")),
            "{what} {name} not logged: {logged}"
        );
    }

    // Real frames on the taps the agent made: simulated guests relayed to i-a's and i-c's taps
    // (opened as a VMM opens them), configured from their own seeds. Guest a reaches guest c;
    // with a source address that is not its lease it does not (anti-spoofing), and with its
    // lease again it does (the control).
    let mut relays = Vec::new();
    let mut guests = Vec::new();
    for (id, tap) in [("i-a", &tap_a), ("i-c", &tap_c)] {
        let ns = sb.add_netns(&format!("g{id}")).unwrap();
        relays.push(Relay::start(&host, tap, &ns, "eth0").unwrap());
        let nc = std::fs::read_to_string(seeds.join(id).join("network-config")).unwrap();
        sim_guest::configure(&ns, "eth0", MacAddr::for_instance(id), Some(&nc)).unwrap();
        guests.push(ns);
    }
    let to_c: IpAddr = "10.0.0.3".parse().unwrap();
    let reaches = |ns: &str| {
        traffic::ping(ns, to_c, 3, Duration::from_millis(400))
            .unwrap()
            .received
            > 0
    };
    assert!(reaches(&guests[0]), "guest a reaches guest c");
    let readdress = |cidr: &str| {
        netns::ip(&guests[0], &["addr", "flush", "dev", "eth0"]).unwrap();
        netns::ip(&guests[0], &["addr", "add", cidr, "dev", "eth0", "nodad"]).unwrap();
    };
    readdress("10.0.0.6/29");
    assert!(!reaches(&guests[0]), "a foreign source address is dropped");
    // The tap guard (tc ingress, before the bridge's nft hooks) dropped it first; after the
    // restart its filters on the reused tap were replaced, not added.
    let guard = pool_status(&client)
        .await
        .guard
        .expect("the tap guard is on");
    assert_eq!(guard.taps, 2, "{guard:?}");
    // (The guest's ARP request for c already carries the foreign sender address.)
    assert!(
        guard.drops["arp"] + guard.drops["ipv4_source"] > 0,
        "{guard:?}"
    );
    for dir in ["ingress", "egress"] {
        let out = netns::exec(&host, "tc", &["filter", "show", "dev", &tap_a, dir], T).unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let filters = text
            .lines()
            .filter(|l| l.contains(" bpf ") && l.contains("handle "))
            .count();
        assert_eq!(filters, 1, "one guard filter on {tap_a} {dir}: {text}");
    }
    readdress("10.0.0.2/29");
    assert!(
        reaches(&guests[0]),
        "with its lease again guest a reaches guest c"
    );

    // The range's nameservers change, so does every NIC spec: the instances are updated in
    // place. Their taps stay (same ifindex; the relays' fds, as a VMM's, keep working) and the
    // seeds carry the new nameservers.
    let ifindex_c = link(&host, &tap_c).unwrap()["ifindex"].clone();
    let _: Value = client
        .put(
            "/v1/pools/p1/range",
            &json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["10.0.0.1", "192.0.2.53"]}),
        )
        .await
        .unwrap();
    assert_eq!(
        link(&host, &tap_a).unwrap()["ifindex"],
        ifindex_a,
        "tap a kept"
    );
    assert_eq!(
        link(&host, &tap_c).unwrap()["ifindex"],
        ifindex_c,
        "tap c kept"
    );
    let nc = std::fs::read_to_string(seeds.join("i-a/network-config")).unwrap();
    let nc: Value = serde_json::from_str(&nc).unwrap();
    assert_eq!(
        nc["ethernets"]["eth0"]["nameservers"]["addresses"],
        json!(["10.0.0.1", "192.0.2.53"])
    );
    assert!(
        reaches(&guests[0]),
        "after the update guest a still reaches guest c"
    );
    let st = pool_status(&client).await;
    assert!(st.last_errors.is_empty(), "{:?}", st.last_errors);
    drop(relays);

    // Someone flushes the ruleset: the audit (every 5 s) repairs it and counts it.
    let before = st.drift_repairs;
    let out = netns::exec(&host, "nft", &["flush", "ruleset"], T).unwrap();
    assert!(out.status.success());
    let t = Instant::now();
    loop {
        let st = pool_status(&client).await;
        if st.drift_repairs > before {
            assert_eq!(st.elements.get("bridge bcd_instances taps"), Some(&2));
            assert!(st.last_audit_at_unix_ms.is_some());
            break;
        }
        assert!(
            t.elapsed() < Duration::from_millis(6500),
            "flush not repaired in time; {}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rs = ruleset(&host);
    assert_eq!(
        tables(&rs),
        ["arp bcd_taps", "bridge bcd_instances", "inet bcd_taps"]
    );
    assert_eq!(elements(&rs, "taps").len(), 2);

    // Delete one instance: its tap, elements and seed go; the other stays.
    let _: Value = client.delete("/v1/instances/i-a").await.unwrap();
    assert_eq!(bc_links(&host), [tap_c]);
    let rs = ruleset(&host);
    assert!(!elements(&rs, "taps").iter().any(|e| e.contains(&tap_a)));
    assert!(!elements(&rs, "tap_ip4").iter().any(|e| e.contains(&tap_a)));
    assert!(!seeds.join("i-a").exists());

    // Delete the last: no tap, no element, no backstop table.
    let _: Value = client.delete("/v1/instances/i-c").await.unwrap();
    assert!(bc_links(&host).is_empty());
    let rs = ruleset(&host);
    assert_eq!(tables(&rs), ["bridge bcd_instances"]);
    assert!(elements(&rs, "taps").is_empty());
    assert_eq!(pool_status(&client).await.instances, 0);

    let status = agent.sigterm().expect("SIGTERM the agent");
    assert!(
        status.success(),
        "agent exit {status:?}; {}",
        agent.log_text()
    );
    drop(sb);
}
