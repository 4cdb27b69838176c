//! One spelling for rules, elements and declarations, whichever side (a planned batch or nft's
//! listing) and whichever nft version they come from (see the parent module's docs for what is
//! left out).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};

/// Whether `s` is a MAC address (`xx:xx:xx:xx:xx:xx`, hex digits of either case).
fn is_mac(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 17
        && b.iter().enumerate().all(|(i, c)| {
            if i % 3 == 2 {
                *c == b':'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// An address in its canonical form, `addr/len` as a prefix, a MAC in lower case, anything else
/// as it is.
fn norm_str(s: &str) -> Value {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Value::String(ip.to_string());
    }
    if s.contains('/')
        && let Ok(net) = s.parse::<IpNet>()
    {
        return norm_prefix(net.addr(), net.prefix_len());
    }
    if is_mac(s) {
        return Value::String(s.to_ascii_lowercase());
    }
    Value::String(s.to_owned())
}

/// A prefix, or the bare address when it is full length.
fn norm_prefix(addr: IpAddr, len: u8) -> Value {
    let full = if addr.is_ipv4() { 32 } else { 128 };
    if len == full {
        Value::String(addr.to_string())
    } else {
        json!({"prefix": {"addr": addr.to_string(), "len": len}})
    }
}

/// `v` in one shape: addresses, prefixes and MACs canonical; anonymous sets sorted, without
/// duplicates, a one-member set as its member; counter values dropped; a match without `op`
/// as `==`; `{}` for an argument-less statement as `null`; `family` beside a literal address in
/// `snat`/`dnat` dropped; an element wrapper (`{"elem": {"val": …, "expires": …}}`) as its value.
pub(crate) fn norm(v: &Value) -> Value {
    match v {
        Value::String(s) => norm_str(s),
        Value::Array(a) => Value::Array(a.iter().map(norm).collect()),
        Value::Object(m) => norm_obj(m),
        other => other.clone(),
    }
}

fn norm_obj(m: &Map<String, Value>) -> Value {
    if m.len() == 1 {
        let (k, inner) = m.iter().next().expect("one entry");
        match (k.as_str(), inner) {
            ("set", Value::Array(members)) => {
                let mut xs = sorted(&members.iter().map(norm).collect::<Vec<_>>());
                xs.dedup();
                if xs.len() == 1 {
                    return xs.remove(0);
                }
                return json!({"set": xs});
            }
            ("counter", Value::Object(_)) => return json!({"counter": null}),
            ("prefix", Value::Object(p)) => {
                let addr = p.get("addr").and_then(Value::as_str);
                let len = p.get("len").and_then(Value::as_u64);
                if let (Some(Ok(addr)), Some(Ok(len))) =
                    (addr.map(str::parse::<IpAddr>), len.map(u8::try_from))
                {
                    return norm_prefix(addr, len);
                }
            }
            ("match", Value::Object(mm)) => {
                let mut mm = mm.clone();
                mm.entry("op").or_insert_with(|| Value::from("=="));
                return json!({"match": norm_obj(&mm)});
            }
            ("snat" | "dnat", Value::Object(n)) if n.contains_key("addr") => {
                let mut n = n.clone();
                n.remove("family");
                return json!({k: norm_obj(&n)});
            }
            ("elem", Value::Object(e)) => {
                if let Some(val) = e.get("val") {
                    return norm(val);
                }
            }
            (_, Value::Object(o)) if o.is_empty() => return json!({k: null}),
            _ => {}
        }
    }
    Value::Object(m.iter().map(|(k, v)| (k.clone(), norm(v))).collect())
}

/// `v` sorted by canonical text.
pub(crate) fn sorted(v: &[Value]) -> Vec<Value> {
    let mut keyed: Vec<(String, Value)> = v.iter().map(|x| (canon(x), x.clone())).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.into_iter().map(|(_, x)| x).collect()
}

/// Canonical JSON text: object keys sorted at every level, whatever the map implementation.
pub(crate) fn canon(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canon(&m[k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(canon).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

/// A string or list of strings as a sorted list (a chain's or flowtable's devices, set flags).
pub(crate) fn string_list(v: &Value) -> Value {
    let mut l: Vec<Value> = match v {
        Value::Array(a) => a.iter().map(norm).collect(),
        other => vec![norm(other)],
    };
    l.sort_by_key(canon);
    l.dedup();
    Value::Array(l)
}

/// The standard priority names (nft's `priority filter` etc.) as numbers, per family.
pub(crate) fn prio_number(family: &str, name: &str) -> Option<i64> {
    Some(match (family, name) {
        ("bridge", "dstnat") => -300,
        ("bridge", "filter") => -200,
        ("bridge", "out") => 100,
        ("bridge", "srcnat") => 300,
        (_, "raw") => -300,
        (_, "mangle") => -150,
        (_, "dstnat") => -100,
        (_, "filter") => 0,
        (_, "security") => 50,
        (_, "srcnat") => 100,
        _ => return None,
    })
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

/// The protocol statement `s` (normalized) is a dependency match for, if it is one.
fn dependency(s: &Value) -> Option<&'static str> {
    let m = s.get("match")?;
    let op = m.get("op").and_then(Value::as_str).unwrap_or("==");
    if op != "==" {
        return None;
    }
    implied_by(m.get("left")?, m.get("right")?.as_str()?)
}

/// A rule's expression (its statement list) as one canonical JSON string, normalized as
/// [`norm`] does and with each dependency match left out when another statement of the rule
/// matches on the protocol it implies (nft adds those and leaves them out of its listing;
/// written by hand they change nothing).
#[must_use]
pub fn normalize_rule(expr: &Value) -> String {
    let Value::Array(stmts) = expr else {
        return canon(&norm(expr));
    };
    let stmts: Vec<Value> = stmts.iter().map(norm).collect();
    let kept: Vec<Value> = stmts
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
        .map(|(_, s)| s.clone())
        .collect();
    canon(&Value::Array(kept))
}

/// One set or map element as a string: `a . b` for a concatenation, `addr/len` for a prefix,
/// `a-b` for a range, `key : data` for a map element (the data as canonical JSON), normalized
/// as [`norm`] does (so `{"elem": {"val": …}}` reads as its value).
#[must_use]
pub fn normalize_element(e: &Value) -> String {
    element_text(&norm(e))
}

fn element_text(e: &Value) -> String {
    match e {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Array(kv) if kv.len() == 2 => {
            format!("{} : {}", element_text(&kv[0]), canon(&kv[1]))
        }
        Value::Object(o) => {
            if let Some(Value::Array(parts)) = o.get("concat") {
                return parts
                    .iter()
                    .map(element_text)
                    .collect::<Vec<_>>()
                    .join(" . ");
            }
            if let Some(p) = o.get("prefix") {
                let addr = p.get("addr").map(element_text).unwrap_or_default();
                let len = p.get("len").map(Value::to_string).unwrap_or_default();
                return format!("{addr}/{len}");
            }
            if let Some(Value::Array(r)) = o.get("range")
                && r.len() == 2
            {
                return format!("{}-{}", element_text(&r[0]), element_text(&r[1]));
            }
            canon(e)
        }
        other => canon(other),
    }
}
