//! Unit tests of the tc comparison: a state built from the plan itself is in sync, and each kind
//! of difference gives the step that repairs it, in a safe order.

use vmnet_plan::ns::limits::{TcTree, plan_limits};

use super::wire::{KClass, KFilter, KQdisc, KStats, ticks};
use super::{DevState, Fix, diff};

fn tree(private: u32, public: u32) -> TcTree {
    plan_limits(private, public, true, "t", Some("p")).trees[0].clone()
}

/// What the kernel reports for `t` when it is exactly as planned (u32 nodes in table 800:).
fn as_planned(t: &TcTree) -> DevState {
    DevState {
        root: Some(KQdisc {
            kind: "htb".into(),
            handle: t.handle,
            defcls: Some(t.default_minor),
            direct_qlen: Some(t.direct_qlen),
            overhead: Some(t.overhead),
        }),
        classes: t
            .classes
            .iter()
            .map(|c| KClass {
                classid: c.classid,
                kind: "htb".into(),
                rate: c.rate,
                ceil: c.rate,
                buffer: ticks(c.burst, c.rate),
                cbuffer: ticks(c.burst, c.rate),
                quantum: c.quantum,
                stats: KStats::default(),
            })
            .collect(),
        filters: t
            .filters
            .iter()
            .map(|f| KFilter {
                kind: "u32".into(),
                protocol: f.protocol,
                prio: f.prio,
                handle: if f.prio == 10 {
                    0x8000_0000
                } else {
                    0x8010_0000
                } | f.handle,
                classid: Some(f.classid),
                terminal: true,
                keys: f.keys.clone(),
            })
            .collect(),
    }
}

fn fixes(t: Option<&TcTree>, st: &DevState) -> Vec<Fix> {
    diff(t, st).into_iter().map(|(f, _)| f).collect()
}

#[test]
fn in_sync_means_no_steps() {
    let t = tree(10, 20);
    assert!(diff(Some(&t), &as_planned(&t)).is_empty());
    assert!(diff(None, &DevState::default()).is_empty());
}

#[test]
fn a_limit_change_is_only_a_class_change() {
    let old = tree(10, 20);
    let new = tree(10, 5);
    let d = diff(Some(&new), &as_planned(&old));
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].0, Fix::SetClass(1));
    assert_eq!(d[0].1, "change class Public 20.00 MiB/s -> 5.00 MiB/s");
}

#[test]
fn nothing_there_builds_the_whole_tree_root_first() {
    let t = tree(10, 20);
    let f = fixes(Some(&t), &DevState::default());
    assert_eq!(f[0], Fix::AddRoot);
    assert_eq!(f[1..3], [Fix::SetClass(0), Fix::SetClass(1)]);
    assert_eq!(f.len(), 3 + t.filters.len());
    assert!(f[3..].iter().all(|x| matches!(x, Fix::SetFilter(_, None))));
}

#[test]
fn a_wrong_root_is_replaced_and_no_tree_wanted_deletes_ours_only() {
    let t = tree(10, 20);
    let mut st = as_planned(&t);
    st.root.as_mut().unwrap().overhead = None;
    let f = fixes(Some(&t), &st);
    assert_eq!(f[..2], [Fix::DelRoot, Fix::AddRoot]);
    assert_eq!(fixes(None, &as_planned(&t)), [Fix::DelRoot]);
    let foreign = DevState {
        root: Some(KQdisc {
            kind: "pfifo_fast".into(),
            handle: 0,
            defcls: None,
            direct_qlen: None,
            overhead: None,
        }),
        ..DevState::default()
    };
    assert!(fixes(None, &foreign).is_empty());
}

#[test]
fn filter_differences_are_repaired_with_the_kernels_handles() {
    let t = tree(10, 20);
    let mut st = as_planned(&t);
    // A classid changed by hand: replaced in place, by its full handle.
    st.filters[1].classid = Some(0x0001_0020);
    // Keys changed: u32 keeps a node's keys on replace, so delete and write again.
    st.filters[2].keys[0].mask = 0;
    // A node nobody planned, and a classifier of another kind.
    st.filters.push(KFilter {
        handle: 0x8000_0009,
        ..st.filters[0].clone()
    });
    st.filters.push(KFilter {
        kind: "bpf".into(),
        protocol: 0x0003,
        prio: 1,
        handle: 1,
        classid: None,
        terminal: false,
        keys: Vec::new(),
    });
    // A stray class.
    st.classes.push(KClass {
        classid: 0x0001_0099,
        ..st.classes[0].clone()
    });
    let f = fixes(Some(&t), &st);
    assert_eq!(
        f,
        [
            Fix::DelFilter {
                prio: 1,
                protocol: 0x0003,
                handle: 0
            },
            Fix::DelFilter {
                prio: 10,
                protocol: 0x0800,
                handle: 0x8000_0003
            },
            Fix::DelFilter {
                prio: 10,
                protocol: 0x0800,
                handle: 0x8000_0009
            },
            Fix::SetFilter(1, Some(0x8000_0002)),
            Fix::SetFilter(2, None),
            Fix::DelClass(0x0001_0099),
        ]
    );
}
