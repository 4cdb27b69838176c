//! Normalization: what of an nft object is content, in one shape whatever nft version wrote it
//! (see the parent module's docs for the list).

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};

pub(super) fn sorted(v: &[Value]) -> Vec<Value> {
    let mut keyed: Vec<(String, Value)> = v.iter().map(|x| (canon(x), x.clone())).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.into_iter().map(|(_, x)| x).collect()
}

/// The standard priority names (nft's `priority filter` etc.) as numbers, per family.
fn prio_number(family: &str, name: &str) -> Option<i64> {
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

pub(super) fn chain_attrs(family: &str, o: &Value) -> Value {
    let mut a = Map::new();
    for k in ["type", "hook", "comment"] {
        if let Some(v) = o.get(k) {
            a.insert(k.into(), norm(v));
        }
    }
    let hook = o.get("hook").and_then(Value::as_str);
    if let Some(p) = o.get("prio") {
        let p = match p.as_str().and_then(|n| prio_number(family, n)) {
            Some(n) => Value::from(n),
            None => norm(p),
        };
        a.insert("prio".into(), p);
    }
    if let Some(d) = o.get("dev").or_else(|| o.get("devices")) {
        a.insert("dev".into(), string_list(d));
    }
    if hook.is_some() {
        let policy = o.get("policy").map_or_else(|| Value::from("accept"), norm);
        a.insert("policy".into(), policy);
    }
    Value::Object(a)
}

/// A string or list of strings as a sorted list.
fn string_list(v: &Value) -> Value {
    let mut l: Vec<Value> = match v {
        Value::Array(a) => a.iter().map(norm).collect(),
        other => vec![norm(other)],
    };
    l.sort_by_key(canon);
    Value::Array(l)
}

pub(super) fn set_attrs(kind: &str, o: &Value) -> Value {
    let mut a = Map::new();
    a.insert("kind".into(), Value::from(kind));
    for (k, v) in o.as_object().into_iter().flatten() {
        match k.as_str() {
            "family" | "table" | "name" | "handle" | "elem" => {}
            "flags" => {
                a.insert(k.clone(), string_list(v));
            }
            _ => {
                a.insert(k.clone(), norm(v));
            }
        }
    }
    Value::Object(a)
}

pub(super) fn elems_of(o: &Value) -> Vec<Value> {
    match o.get("elem") {
        Some(Value::Array(a)) => a.iter().map(norm).collect(),
        Some(v) => vec![norm(v)],
        None => Vec::new(),
    }
}

pub(super) fn object_attrs(o: &Value) -> Value {
    let mut a = Map::new();
    for (k, v) in o.as_object().into_iter().flatten() {
        match k.as_str() {
            "family" | "table" | "name" | "handle" | "packets" | "bytes" | "used" => {}
            "dev" => {
                a.insert(k.clone(), string_list(v));
            }
            _ => {
                a.insert(k.clone(), norm(v));
            }
        }
    }
    Value::Object(a)
}

pub(super) fn rule_value(o: &Value) -> Value {
    let mut r = Map::new();
    r.insert(
        "expr".into(),
        o.get("expr").map_or_else(|| Value::Array(Vec::new()), norm),
    );
    if let Some(c) = o.get("comment") {
        r.insert("comment".into(), c.clone());
    }
    Value::Object(r)
}

/// Normalizes an expression, statement or element (see the module docs).
pub(super) fn norm(v: &Value) -> Value {
    match v {
        Value::String(s) => norm_str(s),
        Value::Array(a) => Value::Array(a.iter().map(norm).collect()),
        Value::Object(m) => norm_obj(m),
        other => other.clone(),
    }
}

fn norm_str(s: &str) -> Value {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Value::String(ip.to_string());
    }
    if s.contains('/')
        && let Ok(net) = s.parse::<IpNet>()
    {
        return norm_prefix(net.addr(), net.prefix_len());
    }
    Value::String(s.to_owned())
}

fn norm_prefix(addr: IpAddr, len: u8) -> Value {
    let full = if addr.is_ipv4() { 32 } else { 128 };
    if len == full {
        Value::String(addr.to_string())
    } else {
        json!({"prefix": {"addr": addr.to_string(), "len": len}})
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
                let mut e = e.clone();
                e.remove("expires");
                if e.len() == 1
                    && let Some(val) = e.get("val")
                {
                    return norm(val);
                }
                return json!({"elem": norm_obj(&e)});
            }
            (_, Value::Object(o)) if o.is_empty() => return json!({k: null}),
            _ => {}
        }
    }
    Value::Object(m.iter().map(|(k, v)| (k.clone(), norm(v))).collect())
}

/// Canonical JSON text: object keys sorted at every level, whatever the map implementation.
pub(super) fn canon(v: &Value) -> String {
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
