//! A restarted agent whose tap ensure fails keeps the taps running VMs hold: a failed start
//! undoes only what it made, and a tap whose instance is placed here is never collected as a
//! stray, whatever its start did. Fakes for nft and the links (`pool_fakes`).

mod common;
mod pool_fakes;

use std::time::Duration;

use common::Harness;
use pool_fakes::{SharedNft, host_links, placed, start_node, tap_of};

/// Taps the fake nft holds elements for (its `taps` set), sorted.
fn held(node: &vmnet_agent::pool::node::PoolNode) -> Vec<String> {
    let fw = node.runtime().firewall();
    let fw = fw.lock().unwrap();
    fw.desired()
        .taps
        .iter()
        .map(|t| t.tap.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_ensure_after_a_restart_keeps_the_taps_running_vms_hold() {
    // The store and the links as an earlier agent left them: two instances here, their taps.
    let h = Harness::new().await;
    placed(&h, &[("inst-a", "h1"), ("inst-b", "h1")]).await;
    let (tap_a, tap_b) = (tap_of("inst-a"), tap_of("inst-b"));
    let links = host_links(&["inst-a", "inst-b"]);
    // inst-a's tap cannot be ensured again (e.g. its guard cannot be attached).
    links.0.lock().unwrap().failing.push(tap_a.clone());
    let nft = SharedNft::default();
    let node = start_node(&h, "br0", &nft, &links, Duration::from_secs(60))
        .await
        .unwrap();

    let out = node.converge(h.agent.db()).await.unwrap();
    assert_eq!(out.started, ["inst-b"], "{out:?}");
    assert!(
        out.errors.len() == 1
            && out.errors[0].contains("instance inst-a")
            && out.errors[0].contains("guard cannot be attached"),
        "{out:?}"
    );
    assert!(out.orphans_deleted.is_empty(), "{out:?}");
    assert!(
        links.0.lock().unwrap().deleted.is_empty(),
        "no tap deleted: {:?}",
        links.0.lock().unwrap().deleted
    );
    assert!(links.0.lock().unwrap().taps.contains_key(&tap_a));
    let mut both = vec![tap_a.clone(), tap_b.clone()];
    both.sort();
    assert_eq!(held(&node), both, "inst-a's tap keeps its elements");
    assert!(!node.is_realised("inst-a").await);

    // The next pass, with the fault gone, starts inst-a on the tap it already has.
    links.0.lock().unwrap().failing.clear();
    let out = node.converge(h.agent.db()).await.unwrap();
    assert_eq!(out.started, ["inst-a"], "{out:?}");
    assert!(out.errors.is_empty(), "{out:?}");
    assert!(links.0.lock().unwrap().deleted.is_empty());
    drop(node);

    // An agent restarted on a bridge that does not exist: every start fails, nothing goes.
    let node = start_node(&h, "br9", &nft, &links, Duration::from_secs(60))
        .await
        .unwrap();
    let out = node.converge(h.agent.db()).await.unwrap();
    assert_eq!(out.errors.len(), 2, "{out:?}");
    assert!(
        out.errors.iter().all(|e| e.contains("bridge br9")),
        "{out:?}"
    );
    assert!(out.orphans_deleted.is_empty() && out.stopped.is_empty());
    assert!(links.0.lock().unwrap().deleted.is_empty());
    assert_eq!(links.0.lock().unwrap().taps.len(), 2);
    assert_eq!(held(&node), both);
}
