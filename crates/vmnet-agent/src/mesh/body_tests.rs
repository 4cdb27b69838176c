use serde_json::json;

use super::*;

fn key(n: u8) -> String {
    STANDARD.encode([n; 32])
}

fn own() -> Own {
    Own {
        public_key: WgKey([0; 32]),
        mesh_address: Some("fdaa::1".parse().unwrap()),
    }
}

fn peer(n: u8) -> serde_json::Value {
    json!({"public_key": key(n), "endpoint": format!("[fd00:10::{n}]:51820"), "mesh_address": format!("fdaa::{n:x}")})
}

fn parse(v: &serde_json::Value) -> Result<SyncBody, Error> {
    parse_sync(v.to_string().as_bytes(), &own())
}

fn refused(v: &serde_json::Value, needle: &str) -> String {
    let e = parse(v).expect_err("refused");
    assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{e}");
    assert!(e.message.contains(needle), "{needle:?} not in {e}");
    e.message
}

#[test]
fn a_valid_body_parses_in_canonical_order() {
    let b = parse(&json!({"peers": [peer(3), peer(2),
        {"public_key": key(4), "endpoint": "10.10.0.4:51820", "mesh_address": "fdaa:0:0::4"}],
        "whitelist": ["fdaa:7::1", "fdaa:1::/32"]}))
    .unwrap();
    let keys: Vec<u8> = b.peers.iter().map(|p| p.public_key.0[0]).collect();
    assert_eq!(keys, [2, 3, 4]);
    assert_eq!(b.peers[2].endpoint, "10.10.0.4:51820".parse().unwrap());
    assert_eq!(b.peers[0].endpoint, "[fd00:10::2]:51820".parse().unwrap());
    assert_eq!(
        b.whitelist,
        vec![
            "fdaa:1::/32".parse().unwrap(),
            "fdaa:7::1/128".parse().unwrap()
        ]
    );
    // The whitelist may be left out; an empty peer set is valid (it removes every managed peer).
    assert_eq!(parse(&json!({"peers": []})).unwrap(), SyncBody::default());
}

#[test]
fn keys_must_be_32_bytes_of_base64_unique_and_not_our_own() {
    let mut p = peer(2);
    p["public_key"] = json!("not base64!");
    refused(
        &json!({"peers": [p]}),
        "peers[0].public_key: \"not base64!\" is not base64",
    );
    p["public_key"] = json!(STANDARD.encode([1u8; 31]));
    refused(&json!({"peers": [p]}), "decodes to 31 bytes, not 32");
    p["public_key"] = json!(key(0));
    refused(&json!({"peers": [p]}), "this host's own key");
    let mut q = peer(3);
    q["public_key"] = json!(key(2));
    refused(&json!({"peers": [peer(2), q]}), "is also peers[0]'s");
}

#[test]
fn endpoints_are_address_and_port_with_ipv6_in_brackets() {
    for (ep, needle) in [
        ("fd00:10::2:51820", "is not address:port"),
        ("[fd00:10::2]", "is not address:port"),
        ("10.10.0.2", "is not address:port"),
        ("host.example:51820", "is not address:port"),
        ("10.10.0.2:0", "port 0"),
        ("0.0.0.0:51820", "not a unicast address"),
        ("[ff02::1]:51820", "not a unicast address"),
        ("[fe80::1%2]:51820", "zone"),
    ] {
        let mut p = peer(2);
        p["endpoint"] = json!(ep);
        let m = refused(&json!({"peers": [p]}), needle);
        assert!(m.contains("peers[0] ("), "{m}");
        assert!(m.contains(".endpoint"), "{m}");
    }
}

#[test]
fn mesh_addresses_lie_in_fdaa_16_and_belong_to_one_peer() {
    for (m, needle) in [
        ("fd00::2", "is not in fdaa::/16"),
        ("10.0.0.1", "is not an IPv6 address"),
        ("fdaa::1", "this host's own mesh address"),
    ] {
        let mut p = peer(2);
        p["mesh_address"] = json!(m);
        refused(&json!({"peers": [p]}), needle);
    }
    let mut q = peer(3);
    q["mesh_address"] = json!("fdaa::2");
    let m = refused(&json!({"peers": [peer(2), q]}), "claimed by peers[0]");
    // Both claimants are named by key.
    assert!(m.contains(&key(2)) && m.contains(&key(3)), "{m}");
}

#[test]
fn the_peer_count_is_bounded() {
    let peers: Vec<_> = (0..=u32::try_from(MAX_PEERS).unwrap())
        .map(|i| {
            let mut k = [1u8; 32];
            k[..4].copy_from_slice(&i.to_be_bytes());
            let [_, a, b, c] = i.to_be_bytes();
            json!({"public_key": STANDARD.encode(k), "endpoint": "10.10.0.2:51820",
                   "mesh_address": Ipv6Addr::new(0xfdaa, 1, 0, 0, 0, u16::from(a), u16::from(b), u16::from(c) + 2).to_string()})
        })
        .collect();
    refused(&json!({"peers": peers}), "10001 peers, at most 10000");
    assert_eq!(
        parse(&json!({"peers": &peers[..MAX_PEERS]}))
            .unwrap()
            .peers
            .len(),
        MAX_PEERS
    );
}

#[test]
fn whitelist_entries_are_mesh_addresses_or_prefixes_written_once() {
    for (w, needle) in [
        ("nonsense", "whitelist[0]: \"nonsense\" is not an IPv6"),
        ("fd00::1", "is not in fdaa::/16"),
        ("fdaa::1/16", "has host bits set"),
        ("fd00::/8", "is not in fdaa::/16"),
    ] {
        refused(&json!({"peers": [], "whitelist": [w]}), needle);
    }
    refused(
        &json!({"peers": [], "whitelist": ["fdaa::5", "fdaa::5/128"]}),
        "whitelist[1]: fdaa::5/128 is listed twice",
    );
}

#[test]
fn unknown_fields_and_bad_json_are_refused() {
    refused(&json!({"peers": [], "extra": 1}), "unknown field");
    let mut p = peer(2);
    p["allowed_ips"] = json!(["fdaa::/16"]);
    refused(&json!({"peers": [p]}), "unknown field `allowed_ips`");
    refused(&json!({"whitelist": []}), "missing field `peers`");
}

#[test]
fn keys_print_as_base64_and_hex() {
    let k: WgKey = key(0xab).parse().unwrap();
    assert_eq!(k.to_string(), key(0xab));
    assert_eq!(k.to_hex(), "ab".repeat(32));
}

#[test]
fn a_body_that_is_not_an_object_is_refused_without_naming_internal_types() {
    for v in [json!([]), json!("peers"), json!(3)] {
        let m = refused(&v, "expected a JSON object");
        assert!(!m.contains("RawSync"), "{m}");
    }
    let m = refused(&json!({"peers": [], "extra": 1}), "unknown field `extra`");
    assert!(!m.contains("RawSync"), "{m}");
}

#[test]
fn a_peer_with_a_repeated_key_is_refused_not_last_wins() {
    let body = format!(
        r#"{{"peers": [{{"public_key": "{}", "public_key": "{}", "endpoint": "[fd00:10::2]:51820", "mesh_address": "fdaa::2"}}]}}"#,
        key(2),
        key(3)
    );
    let e = parse_sync(body.as_bytes(), &own()).expect_err("refused");
    assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{e}");
    assert!(e.message.contains("duplicate key \"public_key\""), "{e}");
}
