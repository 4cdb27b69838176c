//! One spelling for rules and elements, whichever side (a rendered batch or nft's listing) they
//! come from (see the parent module's docs for what is left out).

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde_json::{Map, Value};

/// An address in its canonical form, a MAC in lower case, anything else as it is.
fn canon_str(s: &str) -> String {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return ip.to_string();
    }
    let b = s.as_bytes();
    let is_mac = b.len() == 17
        && b.iter().enumerate().all(|(i, c)| {
            if i % 3 == 2 {
                *c == b':'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    if is_mac {
        s.to_ascii_lowercase()
    } else {
        s.to_owned()
    }
}

/// `v` with addresses and MACs canonical, anonymous sets sorted and counter values dropped.
fn value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::String(canon_str(s)),
        Value::Array(a) => Value::Array(a.iter().map(value).collect()),
        Value::Object(o) => {
            let mut m = Map::new();
            for (k, x) in o {
                let x = match (k.as_str(), x) {
                    // An anonymous set: its elements in one order.
                    ("set", Value::Array(items)) => {
                        let mut items: Vec<Value> = items.iter().map(value).collect();
                        items.sort_by_cached_key(Value::to_string);
                        Value::Array(items)
                    }
                    // An anonymous counter: its values change with every packet.
                    ("counter", Value::Object(_)) => Value::Null,
                    _ => value(x),
                };
                m.insert(k.clone(), x);
            }
            Value::Object(m)
        }
        other => other.clone(),
    }
}

/// The protocol whose payload match makes nft add (and then leave out of its listing) the match
/// `left == right`: `ether type ip` for `ip …`, `meta l4proto tcp` for `tcp …`, and so on.
fn implied_by(left: &Value, right: &str) -> Option<&'static str> {
    let payload = left
        .get("payload")
        .and_then(|p| Some((p.get("protocol")?.as_str()?, p.get("field")?.as_str()?)));
    let meta = left
        .get("meta")
        .and_then(|m| m.get("key"))
        .and_then(Value::as_str);
    let l3 = |r: &str| match r {
        "ip" | "ipv4" => Some("ip"),
        "ip6" | "ipv6" => Some("ip6"),
        _ => None,
    };
    let l4 = |r: &str| match r {
        "tcp" => Some("tcp"),
        "udp" => Some("udp"),
        "udplite" => Some("udplite"),
        "sctp" => Some("sctp"),
        "dccp" => Some("dccp"),
        "icmp" => Some("icmp"),
        "ipv6-icmp" | "icmpv6" => Some("icmpv6"),
        "esp" => Some("esp"),
        "ah" => Some("ah"),
        "comp" => Some("comp"),
        _ => None,
    };
    match (payload, meta) {
        (Some(("ether" | "vlan", "type")), _) => match right {
            "arp" => Some("arp"),
            "8021q" | "vlan" => Some("vlan"),
            r => l3(r),
        },
        (Some(("ip", "protocol") | ("ip6", "nexthdr")), _) | (_, Some("l4proto")) => l4(right),
        (_, Some("nfproto" | "protocol")) => l3(right),
        _ => None,
    }
}

/// Every payload protocol `v` matches on (a `tcp option` counts as `tcp`), with the network
/// protocol an ICMP or IGMP match implies (`icmp` → `ip`, `icmpv6` → `ip6`).
fn protocols(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| protocols(x, out)),
        Value::Object(o) => {
            for (k, x) in o {
                if k == "payload"
                    && let Some(p) = x.get("protocol").and_then(Value::as_str)
                {
                    out.insert(p.to_owned());
                    match p {
                        "icmp" | "igmp" => out.insert("ip".to_owned()),
                        "icmpv6" => out.insert("ip6".to_owned()),
                        _ => false,
                    };
                }
                if k == "tcp option" {
                    out.insert("tcp".to_owned());
                }
                protocols(x, out);
            }
        }
        _ => {}
    }
}

/// The protocol statement `s` is a dependency match for, if it is one.
fn dependency(s: &Value) -> Option<&'static str> {
    let m = s.get("match")?;
    let op = m.get("op").and_then(Value::as_str).unwrap_or("==");
    if op != "==" {
        return None;
    }
    implied_by(m.get("left")?, m.get("right")?.as_str()?)
}

/// A rule's expression (its statement list) as one canonical JSON string: addresses and MACs in
/// one spelling, anonymous sets sorted, counter values dropped, and each dependency match left
/// out when another statement of the rule matches on the protocol it implies (nft adds those
/// and leaves them out of its listing; written by hand they change nothing).
#[must_use]
pub fn normalize_rule(expr: &Value) -> String {
    let Value::Array(stmts) = expr else {
        return value(expr).to_string();
    };
    let stmts: Vec<Value> = stmts.iter().map(value).collect();
    let kept: Vec<&Value> = stmts
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            let Some(proto) = dependency(s) else {
                return true;
            };
            let mut others = BTreeSet::new();
            for (j, t) in stmts.iter().enumerate() {
                if j != *i {
                    protocols(t, &mut others);
                }
            }
            !others.contains(proto)
        })
        .map(|(_, s)| s)
        .collect();
    serde_json::to_string(&kept).unwrap_or_default()
}

/// One set or map element as a string: `a . b` for a concatenation, `addr/len` for a prefix,
/// `a-b` for a range, `key : data` for a map element (the data as canonical JSON), addresses and
/// MACs canonical, `{"elem": {"val": …}}` read as its value.
#[must_use]
pub fn normalize_element(e: &Value) -> String {
    match e {
        Value::String(s) => canon_str(s),
        Value::Number(n) => n.to_string(),
        Value::Array(kv) if kv.len() == 2 => {
            format!("{} : {}", normalize_element(&kv[0]), value(&kv[1]))
        }
        Value::Object(o) => {
            if let Some(inner) = o.get("elem").and_then(|x| x.get("val")) {
                return normalize_element(inner);
            }
            if let Some(Value::Array(parts)) = o.get("concat") {
                return parts
                    .iter()
                    .map(normalize_element)
                    .collect::<Vec<_>>()
                    .join(" . ");
            }
            if let Some(p) = o.get("prefix") {
                let addr = p.get("addr").map(normalize_element).unwrap_or_default();
                let len = p.get("len").map(Value::to_string).unwrap_or_default();
                return format!("{addr}/{len}");
            }
            if let Some(Value::Array(r)) = o.get("range")
                && r.len() == 2
            {
                return format!("{}-{}", normalize_element(&r[0]), normalize_element(&r[1]));
            }
            value(e).to_string()
        }
        other => value(other).to_string(),
    }
}
