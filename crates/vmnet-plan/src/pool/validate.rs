//! The root helper's check of a ruleset before it applies it (spec: "under privilege
//! separation the root helper accepts a ruleset that names these tables and no other").
//!
//! # Design
//! Structural, on the parsed nft JSON — never on text: the document must be exactly
//! `{"nftables": [command, …]}`; each command exactly one of `add` or `delete` holding exactly
//! one object of kind `table`, `chain`, `rule`, `set`, `map` or `element`; every object names
//! its family and table, and the pair must be one of `bridge bcd_instances`, `inet bcd_taps`,
//! `arp bcd_taps`. So `flush ruleset`, `include`, `list`, other tables, other families' objects,
//! flowtables, ct helpers, `metainfo` and any key nft might read as something else are refused,
//! each with a reason. Rule expressions may jump only to chains (no `goto`/`jump` into another
//! table is expressible in nft JSON anyway). Size is bounded.

use super::nft::OWNED_TABLES;
use serde_json::{Map, Value};

/// The largest ruleset accepted, bytes (a full replace for 10 000 taps is about 4 MiB).
pub const MAX_RULESET_BYTES: usize = 32 << 20;

/// Why a ruleset was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ruleset refused: {0}")]
pub struct Refusal(pub String);

fn refuse<T>(msg: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal(msg.into()))
}

fn single(o: &Map<String, Value>, what: &str) -> Result<(String, Value), Refusal> {
    if o.len() != 1 {
        return refuse(format!("{what} must have exactly one key, has {}", o.len()));
    }
    let (k, v) = o
        .iter()
        .next()
        .ok_or_else(|| Refusal(format!("{what} is empty")))?;
    Ok((k.clone(), v.clone()))
}

const KINDS: [&str; 6] = ["table", "chain", "rule", "set", "map", "element"];

/// Checks a ruleset (nft JSON text) against the rules of the module docs.
///
/// # Errors
/// [`Refusal`] with the reason, naming the command index.
pub fn validate(text: &str) -> Result<(), Refusal> {
    if text.len() > MAX_RULESET_BYTES {
        return refuse(format!("{} bytes, at most {MAX_RULESET_BYTES}", text.len()));
    }
    if text.contains('\0') {
        return refuse("contains a NUL byte");
    }
    let doc: Value = serde_json::from_str(text).map_err(|e| Refusal(format!("not JSON: {e}")))?;
    let Some(top) = doc.as_object() else {
        return refuse("top level is not an object");
    };
    let (k, cmds) = single(top, "top level")?;
    if k != "nftables" {
        return refuse(format!("top-level key {k:?}, expected \"nftables\""));
    }
    let Some(cmds) = cmds.as_array() else {
        return refuse("\"nftables\" is not an array");
    };
    if cmds.is_empty() {
        return refuse("no commands");
    }
    for (i, c) in cmds.iter().enumerate() {
        command(c).map_err(|Refusal(m)| Refusal(format!("command {i}: {m}")))?;
    }
    Ok(())
}

fn command(c: &Value) -> Result<(), Refusal> {
    let Some(o) = c.as_object() else {
        return refuse("not an object");
    };
    let (verb, body) = single(o, "command")?;
    if verb != "add" && verb != "delete" {
        return refuse(format!(
            "verb {verb:?} is not allowed (only add and delete)"
        ));
    }
    let Some(bo) = body.as_object() else {
        return refuse(format!("{verb} body is not an object"));
    };
    let (kind, obj) = single(bo, "command body")?;
    if !KINDS.contains(&kind.as_str()) {
        return refuse(format!("object kind {kind:?} is not allowed"));
    }
    let Some(obj) = obj.as_object() else {
        return refuse(format!("{kind} is not an object"));
    };
    let family = obj.get("family").and_then(Value::as_str);
    let table_key = if kind == "table" { "name" } else { "table" };
    let table = obj.get(table_key).and_then(Value::as_str);
    let (Some(family), Some(table)) = (family, table) else {
        return refuse(format!("{kind} does not name its family and table"));
    };
    if !OWNED_TABLES
        .iter()
        .any(|(f, t)| *f == family && *t == table)
    {
        return refuse(format!(
            "{kind} names table {family} {table}, not one of bcd's three tables"
        ));
    }
    if kind == "table" && obj.keys().any(|k| k != "family" && k != "name") {
        return refuse("table has keys other than family and name");
    }
    if kind == "chain" {
        if let Some(h) = obj.get("hook").and_then(Value::as_str) {
            let ok = matches!(
                (family, h),
                ("bridge", "prerouting" | "postrouting")
                    | ("inet", "input" | "forward" | "output")
                    | ("arp", "input" | "output")
            );
            if !ok {
                return refuse(format!("chain hook {family} {h} is not allowed"));
            }
        }
        if obj.get("dev").is_some() {
            return refuse("chain names a device");
        }
    }
    if kind == "rule" {
        let Some(expr) = obj.get("expr").and_then(Value::as_array) else {
            return refuse("rule without an expr array");
        };
        for e in expr {
            statement(e)?;
        }
    }
    Ok(())
}

/// Statements a bcd rule may use: match, verdicts, jumps (within the table), vmap lookups, and
/// exactly one mangle: setting the tap guard's mark bit (`meta mark set meta mark | GUARD_MARK`).
fn statement(e: &Value) -> Result<(), Refusal> {
    let Some(o) = e.as_object() else {
        return refuse("rule statement is not an object");
    };
    let (k, _) = single(o, "rule statement")?;
    match k.as_str() {
        "match" | "accept" | "drop" | "return" | "jump" | "vmap" | "counter" => Ok(()),
        "mangle" if *e == super::nft::rules::guard_mark() => Ok(()),
        "mangle" => refuse("rule statement \"mangle\" may only set the guard mark bit"),
        other => refuse(format!("rule statement {other:?} is not allowed")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> String {
        use crate::pool::nft::{HostAddrs, plan, render_full};
        use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec, NodeSpec};
        let inst = InstanceSpec {
            id: "i-1".into(),
            allocation_id: "a-1".into(),
            policy: NetworkPolicy::Private,
            sandbox: true,
            nics: vec![NicSpec {
                network: Some("br0".parse().unwrap()),
                mac: MacAddr::for_instance("i-1"),
                addresses: vec!["10.0.0.2/24".parse().unwrap()],
                gateway: Some("10.0.0.1".parse().unwrap()),
                gateway6: None,
                nameservers: vec![],
            }],
        };
        let host = HostAddrs {
            own: vec!["10.0.0.1".parse().unwrap()],
            gateways: vec![],
        };
        render_full(
            &plan(
                &NodeSpec {
                    instances: vec![inst],
                },
                &host,
            )
            .unwrap(),
        )
        .to_string()
    }

    #[test]
    fn rendered_rulesets_pass() {
        validate(&full()).unwrap();
    }

    #[test]
    fn refusals_name_the_reason() {
        let cases = [
            (
                r#"{"nftables":[{"flush":{"ruleset":null}}]}"#,
                "verb \"flush\"",
            ),
            (
                r#"{"nftables":[{"add":{"table":{"family":"inet","name":"filter"}}}]}"#,
                "inet filter",
            ),
            (
                r#"{"nftables":[{"add":{"table":{"family":"ip","name":"bcd_taps"}}}]}"#,
                "ip bcd_taps",
            ),
            (r#"{"nftables":[{"include":"/etc/x"}]}"#, "\"include\""),
            (
                r#"{"nftables":[{"add":{"flowtable":{"family":"inet","table":"bcd_taps","name":"f"}}}]}"#,
                "flowtable",
            ),
            (
                r#"{"nftables":[{"add":{"table":{"family":"inet","name":"bcd_taps"},"x":1}}]}"#,
                "exactly one key",
            ),
            (r#"{"nftables":[],"x":1}"#, "exactly one key"),
            (r#"{"nftables":[]}"#, "no commands"),
            ("flush ruleset", "not JSON"),
            (
                r#"{"nftables":[{"add":{"chain":{"family":"inet","table":"bcd_taps","name":"c","type":"filter","hook":"ingress","dev":"eth0","prio":0}}}]}"#,
                "hook",
            ),
            (
                r#"{"nftables":[{"add":{"rule":{"family":"arp","table":"bcd_taps","chain":"input","expr":[{"mangle":{}}]}}}]}"#,
                "mangle",
            ),
            (
                r#"{"nftables":[{"add":{"rule":{"family":"bridge","table":"bcd_instances","chain":"to_tap","expr":[{"mangle":{"key":{"meta":{"key":"mark"}},"value":{"|":[{"meta":{"key":"mark"}},1]}}}]}}}]}"#,
                "guard mark",
            ),
        ];
        for (text, want) in cases {
            let e = validate(text).unwrap_err();
            assert!(e.0.contains(want), "{text}: {e}");
        }
    }
}
