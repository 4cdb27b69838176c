//! The agent on a real kernel (root required): `vmnet serve --netns <sandbox host>` as a child
//! process, several VMs put through the API, the agent killed with SIGKILL while it applies,
//! half-made leftovers planted by hand, then a restart over the same store must converge: every
//! stored VM complete (netns, both veth ends, tap), nothing of a VM that is not stored, and the
//! CLI client (`vmnet vm list`, `vmnet status`, `vmnet apply`) works against it, and refuses
//! an event position from before the restart (`vmnet events --since`).

mod agent_support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agent_support::{links, options, run_cli, sigkill, start, vm};
use serde_json::json;
use vmnet_agent::api::types::{AgentStatus, VmState, VmView};
use vmnet_testkit::{Sandbox, netns, require_root};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn sigkill_during_apply_converges_after_restart() {
    require_root();
    let sb = Sandbox::new("ak").expect("sandbox");
    let p = sb.agent_prefix();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().to_owned();
    let mut agent = start(&options(&sb, &dir, 1)).await;
    let client = agent.client().clone();

    // Put 8 VMs at once (the agent applies them one at a time) and SIGKILL it as soon as the
    // first VM's netns exists: the kill lands while the others are queued or half applied.
    let uids: Vec<u32> = (1..=8).collect();
    let puts: Vec<_> = uids
        .iter()
        .map(|&u| {
            let c = client.clone();
            let body = vm("k", u);
            tokio::spawn(async move { c.put::<VmView>(&format!("/v1/vms/k{u}"), &body).await })
        })
        .collect();
    let first_ns = format!("{p}n0001");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !netns::exists(&first_ns) {
        assert!(
            Instant::now() < deadline,
            "no VM netns appeared; log:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    sigkill(&mut agent);
    let mut answered = 0;
    for t in puts {
        if t.await.unwrap().is_ok() {
            answered += 1;
        }
    }
    eprintln!(
        "{answered} of {} PUTs were answered before the kill",
        uids.len()
    );

    // Plant half-made leftovers as a crash could leave them: a bare netns of a stored VM (no
    // veth, no tap) and an orphan netns with a veth pair for a user id nobody stores.
    let half = format!("{p}n0002");
    if !netns::exists(&half) {
        netns::create(&half).unwrap();
    }
    let orphan_ns = format!("{p}n00ee");
    netns::create(&orphan_ns).unwrap();
    netns::ip(
        &sb.host(),
        &[
            "link",
            "add",
            &format!("{p}h00ee"),
            "type",
            "veth",
            "peer",
            "name",
            &format!("{p}p00ee"),
            "netns",
            &orphan_ns,
        ],
    )
    .unwrap();

    // Restart over the same store: the start pass must converge.
    let mut agent2 = start(&options(&sb, &dir, 1)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored: Vec<VmView> = loop {
        let st: AgentStatus = client.get("/v1/status").await.unwrap();
        let vms: Vec<VmView> = client.get("/v1/vms").await.unwrap();
        if st.reconcile.passes >= 1
            && st.reconcile.last_ok == Some(true)
            && vms.iter().all(|v| v.status.state == VmState::Applied)
        {
            break vms;
        }
        assert!(
            Instant::now() < deadline,
            "no convergence: {st:?}\nlog:\n{}",
            agent2.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(stored.len() >= answered, "every answered PUT is stored");
    let stored_uids: Vec<u32> = stored.iter().map(|v| v.config.user_id).collect();

    // Every stored VM is complete.
    let host_links = links(&sb.host());
    for v in &stored {
        let s = &v.status;
        assert!(
            netns::exists(&s.netns),
            "{}: netns {} missing",
            v.config.id,
            s.netns
        );
        let inside = links(&s.netns);
        assert!(
            inside.contains(&s.tap),
            "{}: tap missing in {}: {inside:?}",
            v.config.id,
            s.netns
        );
        let peer = s.veth_ns.clone().unwrap();
        assert!(
            inside.contains(&peer),
            "{}: veth end missing in {}: {inside:?}",
            v.config.id,
            s.netns
        );
        let host = s.veth_host.clone().unwrap();
        assert!(
            host_links.contains(&host),
            "{}: host veth {host} missing: {host_links:?}",
            v.config.id
        );
    }
    // Nothing of a VM that is not stored: no netns, no host veth with our prefix.
    for ns in netns::list(&format!("{p}n")) {
        let uid = u32::from_str_radix(&ns[p.len() + 1..], 16).unwrap();
        assert!(
            stored_uids.contains(&uid),
            "leftover netns {ns} (stored: {stored_uids:?})"
        );
    }
    for l in host_links
        .iter()
        .filter(|l| l.starts_with(&format!("{p}h")))
    {
        let uid = u32::from_str_radix(&l[p.len() + 1..], 16).unwrap();
        assert!(
            stored_uids.contains(&uid),
            "leftover host veth {l} (stored: {stored_uids:?})"
        );
    }
    assert!(!netns::exists(&orphan_ns), "the orphan was collected");

    // The CLI client against the restarted agent.
    let (ok, out, err) = run_cli(&dir, &["vm", "list", "--output", "json"]);
    assert!(ok, "vm list: {err}");
    let listed: Vec<VmView> = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.len(), stored.len());
    let (ok, out, err) = run_cli(&dir, &["status"]);
    assert!(ok, "status: {err}");
    assert!(out.contains(&format!("prefix {p}")), "{out}");
    // A position from before the restart: sequence numbers start again at 1 in each run, so
    // an old one is refused as CONFLICT, not answered with nothing.
    let (ok, _, err) = run_cli(&dir, &["events", "--since", "1000000"]);
    assert!(!ok);
    assert!(
        err.starts_with("error: CONFLICT: query parameter since: 1000000 is beyond the last event")
            && err.contains("the agent restarted"),
        "{err}"
    );
    let (ok, out, err) = run_cli(&dir, &["events", "--output", "json"]);
    assert!(ok, "events: {err}");
    let run = out
        .lines()
        .next()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["run"].clone())
        .unwrap_or_default();
    let old = if run == "0123456789abcdef" {
        "fedcba9876543210"
    } else {
        "0123456789abcdef"
    };
    let (ok, _, err) = run_cli(&dir, &["events", "--since", "1", "--run", old]);
    assert!(!ok);
    assert!(
        err.contains(&format!(
            "CONFLICT: query parameter run: \"{old}\" is not this agent's run"
        )),
        "{err}"
    );
    let (ok, _, err) = run_cli(&dir, &["vm", "get", "nope"]);
    assert!(!ok);
    assert!(
        err.starts_with("error: NOT_FOUND: vm nope not found"),
        "{err}"
    );
    // Declarative apply with --prune: only the listed VMs stay.
    let spec = json!({"vms": [vm("k", 1), vm("k", 3)]});
    let spec_path = dir.join("host.json");
    std::fs::write(&spec_path, spec.to_string()).unwrap();
    let (ok, out, err) = run_cli(&dir, &["apply", spec_path.to_str().unwrap(), "--prune"]);
    assert!(ok, "apply: {err}");
    eprintln!("{out}");
    let vms: Vec<VmView> = client.get("/v1/vms").await.unwrap();
    let ids: Vec<&str> = vms.iter().map(|v| v.config.id.as_str()).collect();
    assert_eq!(ids, ["k1", "k3"]);
    let left: Vec<String> = netns::list(&format!("{p}n"));
    assert_eq!(left, [format!("{p}n0001"), format!("{p}n0003")]);

    // SIGTERM stops the agent cleanly and removes its socket; the VMs stay applied.
    let status = agent2.sigterm().expect("SIGTERM the agent");
    assert!(
        status.success(),
        "graceful stop: {status:?}\n{}",
        agent2.log_text()
    );
    assert!(
        !dir.join("vmnet.sock").exists(),
        "socket removed on shutdown"
    );
    assert!(netns::exists(&format!("{p}n0001")));
}
