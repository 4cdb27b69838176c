//! The fixed rules of the three tables as nft JSON expressions. Nothing here depends on how
//! many instances exist: per-tap state lives in the sets and maps declared in [`super`].

use serde_json::{Value, json};

/// `{"meta":{"key":k}}`
pub(crate) fn meta(key: &str) -> Value {
    json!({ "meta": { "key": key } })
}

/// `{"payload":{"protocol":p,"field":f}}`
pub(crate) fn payload(proto: &str, field: &str) -> Value {
    json!({ "payload": { "protocol": proto, "field": field } })
}

/// A JSON object from owned pairs (the `json!` macro would clone its arguments).
pub(crate) fn object<const N: usize>(pairs: [(&str, Value); N]) -> Value {
    Value::Object(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

/// A match statement.
pub(crate) fn m(op: &str, left: Value, right: Value) -> Value {
    object([(
        "match",
        object([("op", Value::from(op)), ("left", left), ("right", right)]),
    )])
}

fn concat(a: Value, b: Value) -> Value {
    object([("concat", Value::Array(vec![a, b]))])
}

fn drop() -> Value {
    json!({ "drop": null })
}

fn prefix(addr: &str, len: u8) -> Value {
    json!({ "prefix": { "addr": addr, "len": len } })
}

fn set_ref(name: &str) -> Value {
    Value::String(format!("@{name}"))
}

/// The IPv4 destinations (and sources) a `private` tap may use.
pub(crate) fn private4() -> Value {
    json!({ "set": [
        prefix("10.0.0.0", 8), prefix("172.16.0.0", 12), prefix("192.168.0.0", 16),
        prefix("169.254.0.0", 16), "255.255.255.255"
    ]})
}

fn private6_out() -> Value {
    json!({ "set": [prefix("fc00::", 7), prefix("fe80::", 10), prefix("ff02::", 16)] })
}

fn private6_in() -> Value {
    json!({ "set": [prefix("fc00::", 7), prefix("fe80::", 10), "::"] })
}

/// Rules of chain `from_tap` (every frame a tap sends), in order.
pub(crate) fn from_tap() -> Vec<Vec<Value>> {
    let ifn = || meta("iifname");
    let ether_type = |t: &str| m("==", payload("ether", "type"), json!(t));
    vec![
        // A bc* port without entries (an unknown tap) sends nothing.
        vec![m("!=", ifn(), set_ref("taps")), drop()],
        // Policies: none → drop, private → jump private_out (returns when allowed).
        vec![json!({ "vmap": { "key": ifn(), "data": set_ref("in_policy") } })],
        // Anti-spoofing: source MAC.
        vec![
            m(
                "!=",
                concat(ifn(), payload("ether", "saddr")),
                set_ref("tap_mac"),
            ),
            drop(),
        ],
        // Only IPv4, ARP and IPv6 (no VLAN tags or other protocols that skip the checks below).
        vec![
            m(
                "!=",
                payload("ether", "type"),
                json!({ "set": ["ip", "arp", "ip6"] }),
            ),
            drop(),
        ],
        // ARP: Ethernet/IPv4 only (the fixed-offset sender fields below assume it).
        vec![
            ether_type("arp"),
            m(
                "!=",
                json!({ "concat": [
                    payload("arp", "htype"), payload("arp", "ptype"),
                    payload("arp", "hlen"), payload("arp", "plen"),
                ]}),
                json!({ "set": [{ "concat": [1, "ip", 6, 4] }] }),
            ),
            drop(),
        ],
        // ARP: sender MAC and sender address (0.0.0.0 for probes).
        vec![
            ether_type("arp"),
            m(
                "!=",
                concat(ifn(), payload("arp", "saddr ether")),
                set_ref("tap_mac"),
            ),
            drop(),
        ],
        vec![
            ether_type("arp"),
            m("!=", payload("arp", "saddr ip"), json!("0.0.0.0")),
            m("!=", ifn(), set_ref("ip4_unchecked")),
            m(
                "!=",
                concat(ifn(), payload("arp", "saddr ip")),
                set_ref("tap_ip4"),
            ),
            drop(),
        ],
        // A NIC without an IPv4 address (DHCP elsewhere) may not use another tap's lease, the
        // host's addresses or a gateway as IPv4 or ARP sender.
        vec![
            ether_type("arp"),
            m("==", ifn(), set_ref("ip4_unchecked")),
            m("==", payload("arp", "saddr ip"), set_ref("leased4")),
            drop(),
        ],
        vec![
            ether_type("arp"),
            m("==", ifn(), set_ref("ip4_unchecked")),
            m("==", payload("arp", "saddr ip"), set_ref("reserved4")),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("==", ifn(), set_ref("ip4_unchecked")),
            m("==", payload("ip", "saddr"), set_ref("leased4")),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("==", ifn(), set_ref("ip4_unchecked")),
            m("==", payload("ip", "saddr"), set_ref("reserved4")),
            drop(),
        ],
        // IPv4: 0.0.0.0 only for DHCP requests; otherwise the tap's addresses.
        vec![
            ether_type("ip"),
            m("==", payload("ip", "saddr"), json!("0.0.0.0")),
            m("!=", meta("l4proto"), json!("udp")),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("==", payload("ip", "saddr"), json!("0.0.0.0")),
            m("!=", payload("udp", "dport"), json!(67)),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("!=", payload("ip", "saddr"), json!("0.0.0.0")),
            m("!=", ifn(), set_ref("ip4_unchecked")),
            m(
                "!=",
                concat(ifn(), payload("ip", "saddr")),
                set_ref("tap_ip4"),
            ),
            drop(),
        ],
        // IPv6: :: only for DAD neighbour solicitations and MLD reports; otherwise the tap's
        // addresses (its EUI-64 link-local address included).
        vec![
            ether_type("ip6"),
            m("==", payload("ip6", "saddr"), json!("::")),
            m("!=", meta("l4proto"), json!("ipv6-icmp")),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("ip6", "saddr"), json!("::")),
            m(
                "!=",
                payload("icmpv6", "type"),
                json!({ "set": ["nd-neighbor-solicit", "mld2-listener-report"] }),
            ),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("!=", payload("ip6", "saddr"), json!("::")),
            m(
                "!=",
                concat(ifn(), payload("ip6", "saddr")),
                set_ref("tap_ip6"),
            ),
            drop(),
        ],
        // The drops every tap gets: DHCP server messages (from the server port, or to the
        // client port: clients check only the latter), router advertisements and redirects.
        vec![
            ether_type("ip"),
            m("==", payload("udp", "sport"), json!(67)),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("==", payload("udp", "dport"), json!(68)),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("udp", "sport"), json!(547)),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("udp", "dport"), json!(546)),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m(
                "==",
                payload("icmp", "type"),
                json!({ "set": ["redirect", "router-advertisement"] }),
            ),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m(
                "==",
                payload("icmpv6", "type"),
                json!({ "set": ["nd-router-advert", "nd-redirect"] }),
            ),
            drop(),
        ],
        // The host's gateway addresses: ICMP and DNS (port 53) only.
        vec![
            ether_type("ip"),
            m("==", payload("ip", "daddr"), set_ref("host_gw4")),
            m(
                "!=",
                meta("l4proto"),
                json!({ "set": ["icmp", "tcp", "udp"] }),
            ),
            drop(),
        ],
        vec![
            ether_type("ip"),
            m("==", payload("ip", "daddr"), set_ref("host_gw4")),
            m("==", meta("l4proto"), json!({ "set": ["tcp", "udp"] })),
            m("!=", payload("th", "dport"), json!(53)),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("ip6", "daddr"), set_ref("host_gw6")),
            m(
                "!=",
                meta("l4proto"),
                json!({ "set": ["ipv6-icmp", "tcp", "udp"] }),
            ),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("ip6", "daddr"), set_ref("host_gw6")),
            m("==", meta("l4proto"), json!({ "set": ["tcp", "udp"] })),
            m("!=", payload("th", "dport"), json!(53)),
            drop(),
        ],
        // The host's other addresses.
        vec![
            ether_type("ip"),
            m("==", payload("ip", "daddr"), set_ref("host_block4")),
            drop(),
        ],
        vec![
            ether_type("ip6"),
            m("==", payload("ip6", "daddr"), set_ref("host_block6")),
            drop(),
        ],
    ]
}

/// Rules of chain `to_tap` (every frame sent to a tap), in order.
pub(crate) fn to_tap() -> Vec<Vec<Value>> {
    let ofn = || meta("oifname");
    vec![
        vec![m("!=", ofn(), set_ref("taps")), drop()],
        vec![json!({ "vmap": { "key": ofn(), "data": set_ref("out_policy") } })],
        // Sandboxes: SSH only from the host's own addresses.
        vec![
            m("==", ofn(), set_ref("sandbox_taps")),
            m("==", payload("ether", "type"), json!("ip")),
            m("==", payload("tcp", "dport"), json!(22)),
            m("!=", payload("ip", "saddr"), set_ref("host_all4")),
            drop(),
        ],
        vec![
            m("==", ofn(), set_ref("sandbox_taps")),
            m("==", payload("ether", "type"), json!("ip6")),
            m("==", payload("tcp", "dport"), json!(22)),
            m("!=", payload("ip6", "saddr"), set_ref("host_all6")),
            drop(),
        ],
        // Passed: mark it for the tap guard's egress check (`meta mark set meta mark | GUARD_MARK`).
        vec![guard_mark()],
    ]
}

/// `meta mark set meta mark | GUARD_MARK`.
pub(crate) fn guard_mark() -> Value {
    json!({ "mangle": {
        "key": meta("mark"),
        "value": { "|": [meta("mark"), super::GUARD_MARK] }
    }})
}

/// Rules of chain `private_out` (jumped to for frames from a `private` tap).
pub(crate) fn private_out() -> Vec<Vec<Value>> {
    vec![
        vec![
            m("==", payload("ether", "type"), json!("ip")),
            m("!=", payload("ip", "daddr"), private4()),
            drop(),
        ],
        vec![
            m("==", payload("ether", "type"), json!("ip6")),
            m("!=", payload("ip6", "daddr"), private6_out()),
            drop(),
        ],
    ]
}

/// Rules of chain `private_in` (jumped to for frames to a `private` tap).
pub(crate) fn private_in() -> Vec<Vec<Value>> {
    let mut v4 = private4();
    if let Some(a) = v4["set"].as_array_mut() {
        a.push(json!("0.0.0.0"));
    }
    vec![
        vec![
            m("==", payload("ether", "type"), json!("ip")),
            m("!=", payload("ip", "saddr"), v4),
            drop(),
        ],
        vec![
            m("==", payload("ether", "type"), json!("ip6")),
            m("!=", payload("ip6", "saddr"), private6_in()),
            drop(),
        ],
    ]
}

/// `iifname "bc*" drop` / `oifname "bc*" drop`.
pub(crate) fn tap_wildcard_drop(key: &str) -> Vec<Value> {
    vec![m("==", meta(key), json!("bc*")), drop()]
}
