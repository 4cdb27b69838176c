//! Keyed nf_tables element lookups over netlink (root required): found, missing key, missing
//! map, missing table; the answer is the element's data, read in the namespace the reader was
//! opened in, whatever thread uses it afterwards.

use netlink_packet_netfilter::NetfilterProtoFamily;
use vmnet_kernel::nftelem::ElementReader;
use vmnet_testkit::nft::nft;
use vmnet_testkit::{Sandbox, netns};

#[test]
#[ignore = "needs root: builds a sandbox namespace"]
fn a_keyed_lookup_answers_the_element_or_none() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("ne").expect("sandbox");
    let ns = sb.host();
    nft(&ns, &["add", "table", "inet", "t"]).expect("table");
    nft(
        &ns,
        &[
            "add",
            "map",
            "inet",
            "t",
            "m4",
            "{ type ipv4_addr : ipv4_addr; }",
        ],
    )
    .expect("map");
    nft(
        &ns,
        &[
            "add",
            "map",
            "inet",
            "t",
            "m6",
            "{ type ipv6_addr : ipv6_addr; }",
        ],
    )
    .expect("map");
    nft(
        &ns,
        &[
            "add",
            "element",
            "inet",
            "t",
            "m4",
            "{ 10.200.0.6 : 203.0.113.5 }",
        ],
    )
    .expect("element");
    nft(
        &ns,
        &[
            "add",
            "element",
            "inet",
            "t",
            "m6",
            "{ 2001:db8::57 : fdaa:1::7 }",
        ],
    )
    .expect("element");
    // Opened inside the sandbox, then used from this thread (in the test's own namespace).
    let mut rd = netns::run_in(&ns, ElementReader::open)
        .expect("netns")
        .expect("reader");
    let inet = NetfilterProtoFamily::Inet;
    assert_eq!(
        rd.get(inet, "t", "m4", &[10, 200, 0, 6]).expect("get"),
        Some(vec![203, 0, 113, 5])
    );
    let key6: std::net::Ipv6Addr = "2001:db8::57".parse().unwrap();
    let val6: std::net::Ipv6Addr = "fdaa:1::7".parse().unwrap();
    assert_eq!(
        rd.get(inet, "t", "m6", &key6.octets()).expect("get"),
        Some(val6.octets().to_vec())
    );
    assert_eq!(
        rd.get(inet, "t", "m4", &[10, 200, 0, 7]).expect("get"),
        None
    );
    assert_eq!(
        rd.get(inet, "t", "nosuch", &[10, 200, 0, 6]).expect("get"),
        None
    );
    assert_eq!(
        rd.get(inet, "nosuch", "m4", &[10, 200, 0, 6]).expect("get"),
        None
    );
    // The reader keeps working after misses, and sees changes made meanwhile.
    nft(
        &ns,
        &["delete", "element", "inet", "t", "m4", "{ 10.200.0.6 }"],
    )
    .expect("delete");
    assert_eq!(
        rd.get(inet, "t", "m4", &[10, 200, 0, 6]).expect("get"),
        None
    );
}
