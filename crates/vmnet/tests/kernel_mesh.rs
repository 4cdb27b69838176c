//! The mesh's WireGuard peers with real packets: fleet hosts on one private network, each with
//! `vmnet serve --mesh` running `wireguard-go` in its host namespace. Syncs make handshakes
//! complete and mesh addresses answer across wg0 (the private network carries only UDP to the
//! listen port); removals and address changes touch nothing else; foreign peers and routes
//! survive; missing routes, a deleted interface and a killed `wireguard-go` are repaired from
//! the record; an agent restart re-applies nothing; invalid syncs change nothing.

mod docs_support;
mod mesh_support;

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use mesh_support::{Mesh, answers, body_for, eventually, mesh_of, peer_of, routes, wg_dump};
use serde_json::{Value, json};
use vmnet_model::ErrorCode;
use vmnet_testkit::fleet::PRIVATE_IF;
use vmnet_testkit::netns;
use vmnet_testkit::probe::Capture;

const T: Duration = Duration::from_secs(10);

/// Whether an Ethernet frame is allowed on the private network while the mesh carries traffic:
/// ARP, IPv6 neighbour discovery and multicast listener reports, or UDP from and to the WireGuard port; never a mesh address
/// in an outer header.
fn only_wireguard(frame: &[u8]) -> Result<(), String> {
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    match ethertype {
        0x0806 => Ok(()),
        // IPv4 multicast membership reports (IGMP), the counterpart of MLD below; any other
        // IPv4 is named with its protocol and addresses.
        0x0800 => {
            let ip = &frame[14..];
            if ip[9] == 2 {
                Ok(())
            } else {
                Err(format!(
                    "IPv4 protocol {} from {}.{}.{}.{} to {}.{}.{}.{}",
                    ip[9], ip[12], ip[13], ip[14], ip[15], ip[16], ip[17], ip[18], ip[19]
                ))
            }
        }
        0x86dd => {
            let ip = &frame[14..];
            if ip[8..10] == [0xfd, 0xaa] || ip[24..26] == [0xfd, 0xaa] {
                return Err(format!("a mesh address in an outer header: {ip:02x?}"));
            }
            match ip[6] {
                17 => {
                    let udp = &ip[40..];
                    let (sp, dp) = (
                        u16::from_be_bytes([udp[0], udp[1]]),
                        u16::from_be_bytes([udp[2], udp[3]]),
                    );
                    if dp == mesh_support::PORT && sp == mesh_support::PORT {
                        Ok(())
                    } else {
                        Err(format!("UDP {sp} -> {dp}"))
                    }
                }
                58 if (133..=137).contains(&ip[40]) => Ok(()),
                // Multicast listener reports (behind a hop-by-hop header).
                0 => {
                    let hbh = (usize::from(ip[41]) + 1) * 8;
                    let icmp = ip.get(40 + hbh).copied().unwrap_or(0);
                    if ip[40] == 58 && matches!(icmp, 130..=132 | 143) {
                        Ok(())
                    } else {
                        Err(format!("hop-by-hop then {} (type {icmp})", ip[40]))
                    }
                }
                p => Err(format!("IPv6 next header {p} (type {})", ip[40])),
            }
        }
        t => Err(format!("ethertype {t:#06x}")),
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn handshakes_complete_and_mesh_addresses_answer_with_only_wireguard_on_the_private_network()
{
    let m = Mesh::start(2).await;
    let (a, b) = (&m.nodes[0], &m.nodes[1]);
    let cap = Capture::start(&b.host.ns, PRIVATE_IF).expect("capture");
    // a through the CLI (`vmnet mesh sync FILE`), b through the API.
    let file = a.dir.join("peers.json");
    std::fs::write(&file, body_for(&m.nodes, 0).to_string()).unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(mesh_support::VMNET)
            .arg("--socket")
            .arg(a.dir.join("vmnet.sock"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = cli(&["mesh", "sync", file.to_str().unwrap()]);
    assert!(
        said.starts_with("synced 1 peers: 1 added, 0 updated, 0 removed; routes 1 added"),
        "{said}"
    );
    let mut body = body_for(&m.nodes, 1);
    body["whitelist"] = json!(["fdaa:7::1", "fdaa:1::/32"]);
    let o = b.sync(&body).await.unwrap();
    assert_eq!((o.added, o.whitelist), (1, 2), "{o:?}");
    assert_eq!(b.view().await.whitelist, ["fdaa:1::/32", "fdaa:7::1/128"]);
    assert!(
        answers(a, b.mesh, T),
        "{} does not answer across wg0",
        b.mesh
    );
    assert!(
        answers(b, a.mesh, T),
        "{} does not answer across wg0",
        a.mesh
    );
    for n in &m.nodes {
        let v = n.view().await;
        assert_eq!(v.listen_port, mesh_support::PORT);
        assert_eq!(v.mesh_address, Some(n.mesh.to_string()));
        // 1500 on the private network, IPv6 endpoints: 1420.
        assert_eq!(v.mtu, 1420, "{v:?}");
        assert_eq!(v.peers.len(), 1);
        let p = &v.peers[0];
        assert!(!p.foreign && p.present && p.route == Some(true), "{p:?}");
        assert!(p.last_handshake_unix_secs.is_some(), "no handshake: {p:?}");
        assert!(p.rx_bytes > 0 && p.tx_bytes > 0, "{p:?}");
        assert_eq!(
            p.allowed_ips,
            [format!("{}/128", mesh_of(3 - n.host.index))]
        );
    }
    let frames = cap.frames();
    assert!(
        frames
            .iter()
            .any(|f| f.len() > 14 + 40 + 8 && only_wireguard(f).is_ok() && f[14 + 6] == 17),
        "no WireGuard UDP seen on the private network"
    );
    for f in &frames {
        if let Err(e) = only_wireguard(f) {
            panic!("the private network carried something else than WireGuard: {e}");
        }
    }
    let shown = cli(&["mesh", "show"]);
    assert!(shown.contains(&a.key) && shown.contains(&b.key), "{shown}");
    assert!(
        shown.contains("managed") && shown.contains("mtu           1420"),
        "{shown}"
    );
    // The key file is the host's, mode 0600.
    let key = a.dir.join("state").join("wireguard.key");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn removal_and_address_change_touch_only_their_peer_and_a_restart_reapplies_nothing() {
    let mut m = Mesh::start(3).await;
    m.sync_all().await;
    let (a, b, c) = (&m.nodes[0], &m.nodes[1], &m.nodes[2]);
    assert!(answers(a, b.mesh, T) && answers(a, c.mesh, T));
    let line_of = |ifname: &str, key: &str| {
        wg_dump(ifname)
            .lines()
            .find(|l| l.starts_with(key))
            .map(|l| l.split('\t').take(4).collect::<Vec<_>>().join("\t"))
    };
    let b_before = line_of(&a.ifname, &b.key).expect("b on a");
    // c leaves a's set: its entry and route go, b's stay as they were.
    let o = a
        .sync(&json!({"peers": [peer_of(b)]}))
        .await
        .expect("sync without c");
    assert_eq!(
        (o.removed, o.routes_removed, o.added, o.updated),
        (1, 1, 0, 0),
        "{o:?}"
    );
    assert_eq!(line_of(&a.ifname, &c.key), None);
    assert_eq!(
        line_of(&a.ifname, &b.key).as_deref(),
        Some(b_before.as_str())
    );
    assert_eq!(routes(&a.host.ns, &a.ifname), [b.mesh.to_string()]);
    assert!(!answers(a, c.mesh, Duration::from_secs(1)));

    // An agent restart adopts wireguard-go and re-applies nothing.
    let pid = a.view().await.daemon_pid;
    let hs = a.view().await.peers[0].last_handshake_unix_secs;
    m.nodes[0].restart().await;
    let a = &m.nodes[0];
    let v = a.view().await;
    assert_eq!((v.daemon_pid, v.daemon_starts), (pid, 0), "{v:?}");
    assert_eq!(
        v.peers[0].last_handshake_unix_secs, hs,
        "the tunnel was not re-made"
    );
    let o = a
        .sync(&json!({"peers": [peer_of(&m.nodes[1])]}))
        .await
        .unwrap();
    assert_eq!(
        (o.added, o.updated, o.removed, o.routes_added),
        (0, 0, 0, 0),
        "{o:?}"
    );

    // b's mesh address changes (its agent restarts with the new one): a's old route goes, the
    // new one comes, and traffic reaches the new address.
    let new: std::net::Ipv6Addr = "fdaa::22".parse().unwrap();
    m.nodes[1].mesh = new;
    m.nodes[1].restart().await;
    let (a, b) = (&m.nodes[0], &m.nodes[1]);
    b.sync(&body_for(&m.nodes[..2], 1)).await.unwrap();
    let o = a.sync(&json!({"peers": [peer_of(b)]})).await.unwrap();
    assert_eq!(
        (o.updated, o.routes_added, o.routes_removed),
        (1, 1, 1),
        "{o:?}"
    );
    assert_eq!(routes(&a.host.ns, &a.ifname), ["fdaa::22"]);
    assert!(answers(a, new, T), "the new address does not answer");
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn foreign_peers_and_routes_survive_and_missing_routes_and_interfaces_come_back() {
    let m = Mesh::start(2).await;
    m.sync_all().await;
    let (a, b) = (&m.nodes[0], &m.nodes[1]);
    let foreign = STANDARD.encode([7u8; 32]);
    let st = std::process::Command::new("wg")
        .args([
            "set",
            &a.ifname,
            "peer",
            &foreign,
            "allowed-ips",
            "fdaa:99::1/128",
            "endpoint",
            "[fd00:10::99]:51820",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    netns::ip(
        &a.host.ns,
        &["-6", "route", "add", "fdaa:99::1/128", "dev", &a.ifname],
    )
    .unwrap();
    let dump = |i: &str| {
        wg_dump(i)
            .lines()
            .filter(|l| l.starts_with(&foreign))
            .map(|l| l.split('\t').take(4).collect::<Vec<_>>().join("\t"))
            .collect::<Vec<_>>()
    };
    let before = dump(&a.ifname);
    assert_eq!(before.len(), 1);
    for _ in 0..3 {
        a.sync(&body_for(&m.nodes, 0)).await.unwrap();
        assert_eq!(dump(&a.ifname), before);
        assert!(routes(&a.host.ns, &a.ifname).contains(&"fdaa:99::1".to_owned()));
    }
    let v = a.view().await;
    assert!(
        v.peers.iter().any(|p| p.public_key == foreign && p.foreign),
        "{v:?}"
    );
    // A sync naming the foreign peer, or its address, is refused and changes nothing.
    let mut body = body_for(&m.nodes, 0);
    body["peers"].as_array_mut().unwrap().push(json!({"public_key": foreign, "endpoint": "[fd00:10::99]:51820", "mesh_address": "fdaa:99::1"}));
    assert_eq!(a.sync(&body).await.unwrap_err().code, ErrorCode::Conflict);

    // A managed route deleted by hand is back after the next sync…
    let bm = b.mesh.to_string();
    netns::ip(
        &a.host.ns,
        &["-6", "route", "del", &format!("{bm}/128"), "dev", &a.ifname],
    )
    .unwrap();
    let o = a.sync(&body_for(&m.nodes, 0)).await.unwrap();
    assert_eq!(o.routes_added, 1, "{o:?}");
    assert!(routes(&a.host.ns, &a.ifname).contains(&bm));
    // …and after one reconcile pass (every second here).
    netns::ip(
        &a.host.ns,
        &["-6", "route", "del", &format!("{bm}/128"), "dev", &a.ifname],
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            routes(&a.host.ns, &a.ifname).contains(&bm)
        })
        .await,
        "the route did not come back in a pass"
    );
    // wg0 deleted (as in a reboot): made again and configured from the record.
    netns::ip(&a.host.ns, &["link", "del", &a.ifname]).unwrap();
    assert!(
        eventually(Duration::from_secs(15), || async {
            let v = a.view().await;
            v.peers
                .iter()
                .any(|p| !p.foreign && p.present && p.route == Some(true))
        })
        .await,
        "wg0 was not re-made from the record: {:?}\n{}",
        a.view().await,
        a.logs()
    );
    assert!(answers(a, b.mesh, T), "no traffic after wg0 was re-made");
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn a_killed_wireguard_go_is_restarted_and_handshakes_resume() {
    let m = Mesh::start(2).await;
    m.sync_all().await;
    let (a, b) = (&m.nodes[0], &m.nodes[1]);
    assert!(answers(a, b.mesh, T));
    let pid = a.view().await.daemon_pid.expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(15), || async {
            a.view().await.daemon_pid.is_some_and(|p| p != pid)
        })
        .await,
        "wireguard-go was not restarted"
    );
    assert!(
        answers(a, b.mesh, T),
        "no traffic after the restart: {:?}\n{}",
        a.view().await,
        a.logs()
    );
    let v = a.view().await;
    assert!(v.peers[0].last_handshake_unix_secs.is_some(), "{v:?}");
    assert!(v.daemon_starts >= 2, "{v:?}");
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn invalid_syncs_are_refused_whole_and_leave_wg0_unchanged() {
    let m = Mesh::start(2).await;
    m.sync_all().await;
    let a = &m.nodes[0];
    let before = (wg_dump(&a.ifname), routes(&a.host.ns, &a.ifname));
    let good = peer_of(&m.nodes[1]);
    let with = |f: &str, v: Value| {
        let mut p = good.clone();
        p[f] = v;
        json!({"peers": [p]})
    };
    let other = STANDARD.encode([9u8; 32]);
    let cases: Vec<(Value, &str)> = vec![
        (with("public_key", json!("short")), "public_key"),
        (with("public_key", json!(a.key)), "own key"),
        (with("endpoint", json!("fd00:10::2:51820")), "endpoint"),
        (with("mesh_address", json!("fd00::2")), "fdaa::/16"),
        (
            with("mesh_address", json!(a.mesh.to_string())),
            "own mesh address",
        ),
        (
            json!({"peers": [good, {"public_key": other, "endpoint": "[fd00:10::9]:51820", "mesh_address": m.nodes[1].mesh.to_string()}]}),
            "claimed by peers[0]",
        ),
        (
            json!({"peers": [], "whitelist": ["fd00::1"]}),
            "whitelist[0]",
        ),
    ];
    for (body, needle) in cases {
        let e = a.sync(&body).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidInput, "{e}");
        assert!(e.message.contains(needle), "{needle:?} not in {e}");
        assert_eq!((wg_dump(&a.ifname), routes(&a.host.ns, &a.ifname)), before);
    }
    // One mesh address, one owner: a VM may not take the host's or a peer's mesh address, and
    // a peer may not take a local VM's (each would put two routes for one address on the host).
    let put = |id: &str, uid: u32, mesh: String| {
        let vm = json!({"id": id, "user_id": uid, "tenant": 1, "mesh_ipv6": mesh});
        async move {
            a.client()
                .put::<Value>(&format!("/v1/vms/{}", vm["id"].as_str().unwrap()), &vm)
                .await
        }
    };
    for (mesh, needle) in [
        (a.mesh.to_string(), "this host's mesh address"),
        (m.nodes[1].mesh.to_string(), "mesh address of mesh peer"),
    ] {
        let e = put("clash", 40, mesh).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict, "{e}");
        assert!(e.message.contains(needle), "{needle:?} not in {e}");
    }
    put("web-9", 41, "fdaa:9::41".into())
        .await
        .expect("a VM on its own mesh address");
    let e = a
        .sync(&with("mesh_address", json!("fdaa:9::41")))
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict, "{e}");
    assert!(e.message.contains("mesh address of vm web-9"), "{e}");
    assert_eq!((wg_dump(&a.ifname), routes(&a.host.ns, &a.ifname)), before);

    let peers: Vec<Value> = (0..10_001u32)
        .map(|i| {
            let mut k = [3u8; 32];
            k[..4].copy_from_slice(&i.to_be_bytes());
            json!({"public_key": STANDARD.encode(k), "endpoint": "[fd00:10::9]:51820",
                   "mesh_address": format!("fdaa:5::{:x}:{:x}", i >> 16, i & 0xffff)})
        })
        .collect();
    let e = a.sync(&json!({"peers": peers})).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidInput, "{e}");
    assert!(e.message.contains("10001 peers, at most 10000"), "{e}");
    assert_eq!((wg_dump(&a.ifname), routes(&a.host.ns, &a.ifname)), before);
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn the_books_mesh_sync_example_is_what_the_agent_takes() {
    let blocks = docs_support::json_blocks("mesh-sync");
    assert!(!blocks.is_empty(), "the book shows a sync body");
    let m = Mesh::start(1).await;
    let a = &m.nodes[0];
    for b in &blocks {
        let body: Value = serde_json::from_str(&b.text).expect("the example is JSON");
        let peers = body["peers"].as_array().map_or(0, Vec::len);
        let o = a
            .sync(&body)
            .await
            .unwrap_or_else(|e| panic!("{}: refused: {e}", b.page));
        assert_eq!((o.peers, o.added), (peers, peers), "{}: {o:?}", b.page);
        let v = a.view().await;
        for p in body["peers"].as_array().into_iter().flatten() {
            assert!(
                v.peers
                    .iter()
                    .any(|q| Some(q.public_key.as_str()) == p["public_key"].as_str()),
                "{}: peer {p} on wg0: {v:?}",
                b.page
            );
        }
    }
}
