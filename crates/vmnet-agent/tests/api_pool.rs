//! Pool mode in the agent without a kernel: a fake nft executor (it keeps every applied batch
//! and lists them back, so the census reads what the kernel would hold) and fake links. Instances
//! created, deleted and lost through the API converge this host's taps, set elements and seeds;
//! `GET /v1/instances/{id}/nics` and the pool fields of `GET /v1/status` answer as documented.

mod common;
mod pool_fakes;

use std::net::IpAddr;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use common::{Harness, assert_error, instance, range};
use pool_fakes::{FakeTaps, Pool, SharedNft, host_links, placed, pool, start_node, tap_of};
use serde_json::{Value, json};
use vmnet_model::nic::MacAddr;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_realises_the_nic_seed_and_elements_delete_removes_them() {
    let p = pool().await;
    let st = p.status().await;
    assert_eq!(st["host_id"], "h1");
    assert_eq!(
        st["tables"],
        json!(["bridge bcd_instances"]),
        "no backstop without a NIC"
    );
    assert_eq!(st["instances"], 0);

    let a = p.create("inst-a", "h1").await;
    assert_eq!(a["address"], "10.0.0.2");
    let b = p.create("inst-b", "h1").await;
    assert_eq!(b["address"], "10.0.0.3");
    p.create("inst-other", "h2").await;

    // Taps on the bridge with the instances' MACs; nothing for the other host's instance.
    let taps = p.taps();
    assert_eq!(taps.len(), 2, "{taps:?}");
    assert_eq!(
        taps[&tap_of("inst-a")],
        ("br0".to_owned(), MacAddr::for_instance("inst-a"))
    );
    assert!(taps.contains_key(&tap_of("inst-b")));

    // Seeds carry the leases.
    let nc: Value = serde_json::from_str(
        &std::fs::read_to_string(p.seeds.join("inst-a/network-config")).unwrap(),
    )
    .unwrap();
    assert_eq!(nc["ethernets"]["eth0"]["addresses"], json!(["10.0.0.2/29"]));
    assert_eq!(
        nc["ethernets"]["eth0"]["routes"],
        json!([{"to": "0.0.0.0/0", "via": "10.0.0.1"}])
    );
    assert_eq!(
        nc["ethernets"]["eth0"]["match"]["macaddress"],
        MacAddr::for_instance("inst-a").to_string()
    );
    let meta = std::fs::read_to_string(p.seeds.join("inst-b/meta-data")).unwrap();
    assert!(meta.contains("\"instance-id\": \"inst-b\""), "{meta}");
    assert!(p.seeds.join("inst-b/user-data").exists());
    assert!(!p.seeds.join("inst-other").exists());

    // Status: all three tables, the per-tap elements, two instances.
    let st = p.status().await;
    assert_eq!(
        st["tables"],
        json!(["arp bcd_taps", "bridge bcd_instances", "inet bcd_taps"])
    );
    assert_eq!(st["instances"], 2);
    assert_eq!(st["taps"], 2);
    assert_eq!(st["elements"]["bridge bcd_instances taps"], 2, "{st}");
    assert_eq!(st["elements"]["bridge bcd_instances tap_ip4"], 2, "{st}");
    assert!(st["rules"]["inet bcd_taps"].as_u64().unwrap() > 0);
    assert_eq!(st["last_errors"], json!([]));

    // NICs over the API.
    let (s, v) =
        p.h.call(Method::GET, "/v1/instances/inst-a/nics", None)
            .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["realised"], true);
    let nic = &v["nics"][0];
    assert_eq!(nic["tap"], tap_of("inst-a"));
    assert_eq!(nic["mac"], MacAddr::for_instance("inst-a").to_string());
    assert_eq!(nic["network"], "br0");
    assert_eq!(nic["addresses"], json!(["10.0.0.2/29"]));
    assert_eq!(nic["gateway"], "10.0.0.1");
    assert_eq!(nic["nameservers"], json!(["10.0.0.1", "2001:db8::53"]));
    let xml = v["runtime"]["libvirt_xml"].as_str().unwrap();
    assert!(
        xml.contains(&format!("<target dev='{}'", tap_of("inst-a"))),
        "{xml}"
    );
    assert_eq!(v["runtime"]["cloud_hypervisor_args"][0], "--net");
    assert_eq!(
        v["runtime"]["firecracker"][0]["host_dev_name"],
        tap_of("inst-a")
    );
    assert!(v["runtime"]["qemu_args"].as_array().unwrap().len() >= 4);
    let (_, other) =
        p.h.call(Method::GET, "/v1/instances/inst-other/nics", None)
            .await;
    assert_eq!(other["realised"], false);
    assert_eq!(other["seed_dir"], Value::Null);
    let missing = p.h.call(Method::GET, "/v1/instances/nope/nics", None).await;
    assert_error(&missing, 404, "NOT_FOUND", &["nope"]);

    // Delete one: its tap, elements and seed go; the other stays.
    let (s, _) = p.h.call(Method::DELETE, "/v1/instances/inst-a", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(!p.taps().contains_key(&tap_of("inst-a")));
    assert!(!p.seeds.join("inst-a").exists());
    let st = p.status().await;
    assert_eq!(st["elements"]["bridge bcd_instances taps"], 1, "{st}");
    // Delete the last: the backstop tables go.
    p.h.call(Method::DELETE, "/v1/instances/inst-b", None).await;
    assert!(p.taps().is_empty());
    let st = p.status().await;
    assert_eq!(st["tables"], json!(["bridge bcd_instances"]), "{st}");
    assert_eq!(st["instances"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_loss_removes_the_nics_and_reconcile_repairs_taps_orphans_and_flushes() {
    let p = pool().await;
    p.create("inst-a", "h1").await;
    p.create("inst-b", "h1").await;

    // A tap deleted behind our back comes back; a stray bc* link goes.
    let orphan = "bc0123456789n0".to_owned();
    {
        let mut l = p.links.0.lock().unwrap();
        l.taps.remove(&tap_of("inst-a"));
        l.taps.insert(
            orphan.clone(),
            ("br0".into(), "02:00:00:00:00:01".parse().unwrap()),
        );
    }
    let foreign = "bcm0".to_owned();
    p.links.0.lock().unwrap().taps.insert(
        foreign.clone(),
        ("br0".into(), "02:00:00:00:00:02".parse().unwrap()),
    );
    let out = p.h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let taps = p.taps();
    assert!(
        taps.contains_key(&foreign),
        "a link not named like a tap stays"
    );
    p.links.0.lock().unwrap().taps.remove(&foreign);
    assert!(
        taps.contains_key(&tap_of("inst-a")) && !taps.contains_key(&orphan),
        "{taps:?}"
    );

    // A flushed ruleset is repaired by the audit and counted.
    p.nft.flush();
    let t = std::time::Instant::now();
    loop {
        let st = p.status().await;
        // The repair is counted inside the audit, its time recorded right after it.
        if st["drift_repairs"].as_u64().unwrap() > 0 && st["last_audit_at_unix_ms"].is_i64() {
            assert_eq!(st["elements"]["bridge bcd_instances taps"], 2, "{st}");
            assert!(st["last_drift"].to_string().contains("missing"), "{st}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "not repaired: {st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Host loss: the instances (not recreated) leave this host with their NICs and seeds.
    let (s, v) = p.h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(p.taps().is_empty(), "{:?}", p.taps());
    assert!(!p.seeds.join("inst-a").exists() && !p.seeds.join("inst-b").exists());
    let st = p.status().await;
    assert_eq!(st["instances"], 0);
    assert_eq!(st["tables"], json!(["bridge bcd_instances"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tap_that_cannot_be_made_leaves_no_rules_and_is_reported() {
    let p = pool().await;
    p.links.0.lock().unwrap().bridges.clear();
    p.create("inst-a", "h1").await;
    assert!(p.taps().is_empty());
    let st = p.status().await;
    assert_eq!(st["instances"], 0);
    assert_eq!(st["taps"], 0);
    assert_eq!(st["tables"], json!(["bridge bcd_instances"]), "{st}");
    let errs = st["last_errors"].to_string();
    assert!(
        errs.contains("inst-a") && errs.contains("bridge br0"),
        "{errs}"
    );
    // The bridge appears: the next pass realises the instance.
    p.links.0.lock().unwrap().bridges.push("br0".into());
    p.h.agent.reconcile().await.unwrap();
    assert!(p.taps().contains_key(&tap_of("inst-a")));
    assert_eq!(p.status().await["instances"], 1);
}

#[tokio::test]
async fn a_bc_bridge_is_refused() {
    let h = Harness::new().await;
    let e = start_node(
        &h,
        "bc0",
        &SharedNft::default(),
        &FakeTaps::default(),
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput);
    assert!(e.message.contains("bc0"), "{e}");
}

#[tokio::test]
async fn without_pool_mode_status_has_no_pool_and_nics_are_not_realised() {
    let h = Harness::new().await;
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["pool"], Value::Null);
    h.with_host("h1", 1, 512).await;
    h.with_range("p9", range("192.168.9.0/24", "192.168.9.1"))
        .await;
    h.with_instance(instance("i1", "p9")).await;
    let (s, v) = h.call(Method::GET, "/v1/instances/i1/nics", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["realised"], false);
    assert_eq!(v["nics"][0]["network"], "br0");
    assert_eq!(v["nics"][0]["addresses"], json!(["192.168.9.2/24"]));
    assert_eq!(v["nics"][0]["gateway"], "192.168.9.1");
    assert_eq!(v["nics"][0]["nameservers"], json!([]));
    assert_eq!(v["seed_dir"], Value::Null);
}

/// The store's range of `pool_id` set directly (no API call, so no pass runs).
async fn set_range_in_store(db: &vmnet_ipam::Db, pool_id: &str, gateway: &str, dns: &[&str]) {
    use vmnet_ipam::Store;
    let mut tx = db.begin().await.unwrap();
    vmnet_ipam::set_ip_pool(
        &mut tx,
        vmnet_model::pool::SetIpPool {
            pool_id: pool_id.into(),
            cidr: "10.0.0.0/29".into(),
            gateway: gateway.into(),
            first_host: None,
            last_host: None,
            dns: dns.iter().map(|d| (*d).to_owned()).collect(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

fn network_config(p: &Pool, id: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p.seeds.join(id).join("network-config")).unwrap())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_change_updates_running_instances_in_place_without_new_taps() {
    let p = pool().await;
    p.create("inst-a", "h1").await;
    p.create("inst-b", "h1").await;
    let node = p.h.agent.pool().unwrap().clone();
    let taps_before = p.taps();
    let batches_before = p.nft.0.batches.lock().unwrap().len();
    p.links.0.lock().unwrap().ensured.clear();

    // New nameservers: every NIC spec changes, no set element does.
    set_range_in_store(p.h.agent.db(), "p1", "10.0.0.1", &["192.0.2.53"]).await;
    let out = node.converge(p.h.agent.db()).await.unwrap();
    assert_eq!(out.updated, ["inst-a", "inst-b"], "{out:?}");
    assert!(out.stopped.is_empty() && out.started.is_empty(), "{out:?}");
    assert!(out.errors.is_empty(), "{out:?}");
    assert!(
        p.links.0.lock().unwrap().deleted.is_empty(),
        "no tap deleted: {:?}",
        p.links.0.lock().unwrap().deleted
    );
    assert_eq!(p.taps(), taps_before);
    let mut ensured = p.links.0.lock().unwrap().ensured.clone();
    ensured.sort();
    let mut want = vec![tap_of("inst-a"), tap_of("inst-b")];
    want.sort();
    assert_eq!(ensured, want, "each tap ensured again with its new entry");
    assert_eq!(
        p.nft.0.batches.lock().unwrap().len(),
        batches_before,
        "no element changed, nothing applied"
    );
    assert_eq!(
        network_config(&p, "inst-a")["ethernets"]["eth0"]["nameservers"]["addresses"],
        json!(["192.0.2.53"])
    );
    let (_, v) =
        p.h.call(Method::GET, "/v1/instances/inst-b/nics", None)
            .await;
    assert_eq!(v["nics"][0]["nameservers"], json!(["192.0.2.53"]), "{v}");
    assert_eq!(v["realised"], true);
    // A second pass has nothing to do.
    let again = node.converge(p.h.agent.db()).await.unwrap();
    assert!(
        again.updated.is_empty() && again.errors.is_empty(),
        "{again:?}"
    );

    // A new gateway through the API: the tables carry it (a full replace, since the host's
    // gateways are in every tap's drop), the taps stay, the seeds route through it.
    let (st, v) =
        p.h.call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.6", "first_host": "10.0.0.2", "last_host": "10.0.0.5", "dns": ["192.0.2.53"]})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(p.links.0.lock().unwrap().deleted.is_empty());
    assert_eq!(p.taps(), taps_before);
    let last = p.nft.0.batches.lock().unwrap().last().unwrap().clone();
    let last: Value = serde_json::from_str(&last).unwrap();
    let reserved: Vec<Value> = last["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["add"]["element"]["name"] == "reserved4")
        .flat_map(|c| c["add"]["element"]["elem"].as_array().unwrap().clone())
        .collect();
    assert!(reserved.contains(&json!("10.0.0.6")), "{reserved:?}");
    assert!(!reserved.contains(&json!("10.0.0.1")), "{reserved:?}");
    {
        let fw = node.runtime().firewall();
        let fw = fw.lock().unwrap();
        assert_eq!(fw.desired().taps.len(), 2);
        assert_eq!(
            fw.desired().host.gateways,
            vec!["10.0.0.6".parse::<IpAddr>().unwrap()]
        );
    }
    assert_eq!(
        network_config(&p, "inst-b")["ethernets"]["eth0"]["routes"],
        json!([{"to": "0.0.0.0/0", "via": "10.0.0.6"}])
    );
    let st = p.status().await;
    assert_eq!(st["instances"], 2);
    assert_eq!(st["elements"]["bridge bcd_instances taps"], 2, "{st}");
    assert_eq!(st["last_errors"], json!([]), "{st}");
    assert!(
        node.runtime()
            .firewall()
            .lock()
            .unwrap()
            .audit()
            .unwrap()
            .drift
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_loads_the_placed_taps_first_and_drops_the_elements_of_the_gone() {
    // The store as an earlier agent left it: three instances here, one elsewhere, their taps.
    let h = Harness::new().await;
    placed(
        &h,
        &[
            ("inst-a", "h1"),
            ("inst-b", "h1"),
            ("inst-c", "h1"),
            ("inst-x", "h2"),
        ],
    )
    .await;
    let links = host_links(&["inst-a", "inst-b", "inst-c", "inst-gone"]);
    let nft = SharedNft::default();
    let node = start_node(&h, "br0", &nft, &links, Duration::from_secs(60))
        .await
        .unwrap();

    // The first load already holds the backstop and the placed instances' taps.
    let batches = nft.0.batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 1, "{batches:?}");
    let first: Value = serde_json::from_str(&batches[0]).unwrap();
    let cmds = first["nftables"].as_array().unwrap();
    let tables: Vec<String> = cmds
        .iter()
        .filter_map(|c| c["add"]["table"].as_object())
        .map(|t| {
            format!(
                "{} {}",
                t["family"].as_str().unwrap(),
                t["name"].as_str().unwrap()
            )
        })
        .collect();
    for t in ["bridge bcd_instances", "inet bcd_taps", "arp bcd_taps"] {
        assert!(tables.iter().any(|x| x == t), "{t} in {tables:?}");
    }
    let mut loaded: Vec<String> = cmds
        .iter()
        .filter(|c| c["add"]["element"]["name"] == "taps")
        .flat_map(|c| c["add"]["element"]["elem"].as_array().unwrap().clone())
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    loaded.sort();
    let mut placed = vec![tap_of("inst-a"), tap_of("inst-b"), tap_of("inst-c")];
    placed.sort();
    assert_eq!(loaded, placed);
    assert!(
        links.0.lock().unwrap().deleted.is_empty(),
        "no tap touched yet"
    );

    // Before the first pass inst-c goes (no pass runs: pool mode is not attached yet).
    let (st, _) = h.call(Method::DELETE, "/v1/instances/inst-c", None).await;
    assert_eq!(st, StatusCode::OK);

    // The first pass reuses the placed taps without applying anything for them, collects the
    // stray taps and removes inst-c's elements in one element batch.
    let out = node.converge(h.agent.db()).await.unwrap();
    assert!(out.errors.is_empty(), "{out:?}");
    assert_eq!(out.started, ["inst-a", "inst-b"]);
    let mut orphans = out.orphans_deleted.clone();
    orphans.sort();
    let mut gone = vec![tap_of("inst-c"), tap_of("inst-gone")];
    gone.sort();
    assert_eq!(orphans, gone);
    let deleted = links.0.lock().unwrap().deleted.clone();
    assert!(
        !deleted.contains(&tap_of("inst-a")) && !deleted.contains(&tap_of("inst-b")),
        "{deleted:?}"
    );
    let batches = nft.0.batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 2, "{batches:?}");
    assert!(
        batches[1].starts_with(r#"{"nftables":[{"delete":{"element""#)
            && batches[1].contains(&tap_of("inst-c"))
            && !batches[1].contains(&tap_of("inst-a")),
        "{}",
        batches[1]
    );
    {
        let fw = node.runtime().firewall();
        let mut fw = fw.lock().unwrap();
        let held: Vec<String> = fw
            .desired()
            .taps
            .iter()
            .map(|t| t.tap.to_string())
            .collect();
        let mut want = vec![tap_of("inst-a"), tap_of("inst-b")];
        want.sort();
        assert_eq!(held, want);
        assert!(fw.audit().unwrap().drift.is_empty());
    }
    assert!(node.is_realised("inst-a").await && !node.is_realised("inst-c").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nics_carry_the_plugin_spec_and_a_lease_outside_a_replaced_range_is_32() {
    let p = pool().await;
    p.create("inst-a", "h1").await;
    let (s, inst) = p.h.call(Method::GET, "/v1/instances/inst-a", None).await;
    assert_eq!(s, StatusCode::OK, "{inst}");
    let alloc = inst["allocation_id"].as_str().unwrap().to_owned();

    let (s, v) =
        p.h.call(Method::GET, "/v1/instances/inst-a/nics", None)
            .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["runtime"]["plugin"],
        json!({
            "instance_id": "inst-a",
            "allocation_id": alloc,
            "nics": [{
                "tap": tap_of("inst-a"),
                "network": "br0",
                "mac": MacAddr::for_instance("inst-a").to_string(),
                "addresses": ["10.0.0.2/29"],
                "gateway": "10.0.0.1",
                "nameservers": ["10.0.0.1", "2001:db8::53"],
            }],
        })
    );

    // Replace the range: the lease is kept although the new range does not contain it. The
    // host's NIC, the plugin spec and Instance.addresses all give it as /32 with the new
    // range's gateway and nameservers; nothing fails.
    let (s, r) =
        p.h.call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.8.0/29", "gateway": "10.0.8.1", "dns": ["10.0.8.1"]})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let (s, v) =
        p.h.call(Method::GET, "/v1/instances/inst-a/nics", None)
            .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["nics"][0]["addresses"], json!(["10.0.0.2/32"]));
    assert_eq!(v["nics"][0]["gateway"], "10.0.8.1");
    assert_eq!(v["nics"][0]["nameservers"], json!(["10.0.8.1"]));
    let plugin_nic = &v["runtime"]["plugin"]["nics"][0];
    assert_eq!(plugin_nic["addresses"], json!(["10.0.0.2/32"]));
    assert_eq!(plugin_nic["gateway"], "10.0.8.1");
    let (_, inst) = p.h.call(Method::GET, "/v1/instances/inst-a", None).await;
    assert_eq!(inst["addresses"], v["nics"][0]["addresses"], "{inst}");
}
