//! The kernel's link-watch work after a burst of creates (root required).
//!
//! The kernel handles a link's carrier change in its link-watch work. It handles changes it
//! counts as not urgent at most 100 per second. The others wait on one global list, and every
//! later link event walks that list with interrupts off, holding RTNL. Creating VMs faster than
//! 100 per second must not leave their links there. Such a link shows operstate `UNKNOWN`:
//! its state was never worked out. The links are read with dumps, because a read of one link
//! (`ip link show dev X`) settles that link as a side effect.

mod ns_support;

use ns_support::{Env, vm_json};
use vmnet_testkit::netns;

/// VMs created back to back: well over a second's worth of non-urgent link-watch work.
const COUNT: u32 = 150;

/// `(name, operstate, ifindex, link_index)` of every link in `ns`, from one dump.
fn links(ns: &str) -> Vec<(String, String, u64, Option<u64>)> {
    let out = netns::ip(ns, &["-j", "link"]).expect("ip -j link");
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j output");
    v.as_array()
        .expect("a list of links")
        .iter()
        .map(|l| {
            (
                l["ifname"].as_str().unwrap_or_default().to_owned(),
                l["operstate"].as_str().unwrap_or_default().to_owned(),
                l["ifindex"].as_u64().unwrap_or_default(),
                l["link_index"].as_u64(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_burst_of_creates_leaves_no_link_waiting_for_link_watch() {
    let env = Env::new();
    let plans: Vec<_> = (0x100..0x100 + COUNT)
        .map(|u| {
            let mesh = format!("fdaa::{u:x}");
            env.plan(&vm_json(
                &format!("lw{u}"),
                u,
                Some(&mesh),
                &[("0.0.0.0/0", "host")],
            ))
        })
        .collect();
    let started = std::time::Instant::now();
    for p in &plans {
        env.driver.apply(p).await.expect("apply");
    }
    let took = started.elapsed();

    let host = links(&env.sb.host());
    let mut stuck = Vec::new();
    for p in &plans {
        let v = p.veth.as_ref().expect("a veth pair");
        let (_, state, index, peer) = host
            .iter()
            .find(|(n, ..)| *n == v.host_name)
            .unwrap_or_else(|| panic!("no host end {}", v.host_name));
        // The ends' indexes differ: the kernel takes a link whose index equals its peer's for
        // one that stacks on nothing, and its carrier changes for not urgent.
        assert_ne!(
            Some(*index),
            *peer,
            "{}: both veth ends have ifindex {index}",
            v.host_name
        );
        if state == "UNKNOWN" {
            stuck.push(v.host_name.clone());
        }
        let tap = links(&p.netns)
            .into_iter()
            .find(|(n, ..)| *n == p.tap.name)
            .unwrap_or_else(|| panic!("no tap {}", p.tap.name));
        if tap.1 == "UNKNOWN" {
            stuck.push(p.tap.name.clone());
        }
    }
    assert!(
        stuck.is_empty(),
        "{} of {} links still wait for link-watch after {COUNT} creates in {took:?}: {stuck:?}",
        stuck.len(),
        2 * COUNT
    );
}
