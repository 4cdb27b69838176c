//! Round trips through netlink-packet-route's own encoder and parser: what [`super`] writes
//! reads back (through the same parse path as a kernel dump) as the plan.

use rtnetlink::packet_core::{Emitable, Parseable};
use vmnet_plan::ns::limits::{MIB, UNLIMITED_BYTES_PER_SEC, plan_limits};

use super::*;

fn round_trip(m: &TcMessage) -> TcMessage {
    let mut buf = vec![0u8; m.buffer_len()];
    m.emit(&mut buf);
    TcMessage::parse(buf.as_slice()).expect("parses")
}

#[test]
fn qdisc_options_and_size_table_read_back() {
    let p = plan_limits(10, 20, true, "t", Some("p"));
    let t = &p.trees[0];
    let q = parse_qdisc(&round_trip(&qdisc_msg(7, t)));
    assert_eq!(
        q,
        KQdisc {
            kind: "htb".into(),
            handle: 0x0001_0000,
            defcls: Some(0),
            direct_qlen: Some(1000),
            overhead: Some(-14),
        }
    );
}

#[test]
fn classes_read_back_with_32_and_64_bit_rates() {
    let p = plan_limits(10, 0, true, "t", Some("p"));
    let t = &p.trees[1];
    for c in &t.classes {
        let k = parse_class(&round_trip(&class_msg(9, t.handle, c)));
        assert_eq!(k.classid, c.classid);
        assert_eq!((k.rate, k.ceil), (c.rate, c.rate));
        assert_eq!(k.buffer, ticks(c.burst, c.rate));
        assert_eq!(k.quantum, c.quantum);
    }
    assert_eq!(t.classes[0].rate, 10 * MIB);
    assert_eq!(t.classes[1].rate, UNLIMITED_BYTES_PER_SEC);
}

#[test]
fn u32_nodes_read_back_with_priority_protocol_and_keys() {
    let p = plan_limits(10, 20, true, "t", Some("p"));
    for f in &p.trees[1].filters {
        let mut m = round_trip(&filter_msg(9, 0x0001_0000, f, None));
        // A dump names the node with its hash table.
        m.header.handle = TcHandle::from(0x8000_0000 | f.handle);
        let k = parse_filter(&m).expect("a node");
        assert_eq!((k.prio, k.protocol), (f.prio, f.protocol));
        assert_eq!(k.handle & 0xfff, f.handle);
        assert_eq!(k.classid, Some(f.classid));
        assert!(k.terminal);
        assert_eq!(k.keys, f.keys);
    }
}

#[test]
fn ticks_are_64_ns_units() {
    // 1 MiB at 1 MiB/s is one second: 15,625,000 ticks of 64 ns.
    assert_eq!(ticks(MIB, MIB), 15_625_000);
    assert_eq!(ticks(1, u64::MAX), 1);
}
