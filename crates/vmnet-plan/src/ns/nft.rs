//! nftables JSON for namespace mode, rendered by pure functions (snapshot-tested).
//!
//! Each ruleset is one `nft -j -f -` transaction: `add table` (so the delete cannot fail),
//! `delete table`, then the table with its chains and rules — an atomic replacement.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The comment on the first rule of the VM table (and of the host table): `vmnet:<fingerprint>`.
pub const FINGERPRINT_PREFIX: &str = "vmnet:";

fn replace_table(family: &str, name: &str) -> Vec<Value> {
    let t = json!({"table": {"family": family, "name": name}});
    vec![
        json!({"add": t.clone()}),
        json!({"delete": t.clone()}),
        json!({"add": t}),
    ]
}

fn mss_rule(table: &str, nfproto: &str, mss: u32) -> Value {
    json!({"add": {"rule": {"family": "inet", "table": table, "chain": "mss", "expr": [
        {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto}},
        {"match": {"op": "in", "left": {"payload": {"protocol": "tcp", "field": "flags"}}, "right": "syn"}},
        {"match": {"op": ">", "left": {"tcp option": {"name": "maxseg", "field": "size"}}, "right": mss}},
        {"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": mss}}
    ]}}})
}

/// The VM netns ruleset: table `inet <table>` with chain `mss` (forward, priority mangle) clamping
/// the MSS of forwarded TCP SYN and SYN-ACK to `mtu - 40` (IPv4) and `mtu - 60` (IPv6), and, when
/// `nat` is `Some((peer veth, transit address))`, chain `postrouting` (nat, srcnat) with
/// `oifname <peer> ip saddr 172.16.0.0/30 snat to <transit address>`.
///
/// Returns the transaction, its fingerprint (over all of it) and its shape fingerprint (over all
/// of it but the rules of the firewall's `fw_in` and `fw_out` and of the public DNAT chain), the
/// latter written as the comment of the first rule: a firewall or public IPv4 change applied to
/// those chains alone leaves that rule as it was.
/// With `dnat` (`Some((peer veth, transit address if the VM has a public IPv4))`, a VM with a
/// veth and NAT) also chain `prerouting` ([`super::public::ns_dnat_chain`]), with the rule passing the
/// transit address on to the guest when there is one ([`super::public::ns_dnat_rule`]). With
/// `firewall` (`Some((peer veth, tap, plan))`) also the filter chains
/// ([`super::firewall::nft_commands`]). With `guard` (`Some(tap)`) also the chain dropping
/// forwarded packets from the tap the guest guard did not pass ([`super::guard::nft_commands`]).
pub fn vm_ruleset(
    table: &str,
    mtu: u32,
    nat: Option<(&str, Ipv4Addr)>,
    dnat: Option<(&str, Option<Ipv4Addr>)>,
    firewall: Option<(&str, &str, &super::firewall::FirewallPlan)>,
    guard: Option<&str>,
) -> (Value, String, String) {
    let mut cmds = replace_table("inet", table);
    cmds.push(
        json!({"add": {"chain": {"family": "inet", "table": table, "name": "mss",
        "type": "filter", "hook": "forward", "prio": -150, "policy": "accept"}}}),
    );
    cmds.push(mss_rule(table, "ipv4", mtu - 40));
    cmds.push(mss_rule(table, "ipv6", mtu - 60));
    if let Some((peer, addr)) = nat {
        cmds.push(
            json!({"add": {"chain": {"family": "inet", "table": table, "name": "postrouting",
            "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}}),
        );
        cmds.push(json!({"add": {"rule": {"family": "inet", "table": table, "chain": "postrouting", "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": peer}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                "right": {"prefix": {"addr": "172.16.0.0", "len": 30}}}},
            {"snat": {"family": "ip", "addr": addr.to_string()}}
        ]}}}));
    }
    if let Some((peer, transit)) = dnat {
        cmds.push(super::public::ns_dnat_chain(table));
        cmds.extend(
            transit.map(|a| super::public::ns_dnat_rule(table, peer, a, super::GUEST_IPV4)),
        );
    }
    if let Some(tap) = guard {
        cmds.extend(super::guard::nft_commands(table, tap));
    }
    if let Some((peer, tap, fw)) = firewall {
        cmds.extend(super::firewall::nft_commands(table, peer, tap, fw));
    }
    let shape = fingerprint(&without_rule_chains(&cmds));
    cmds[4]["add"]["rule"]["comment"] = Value::String(format!("{FINGERPRINT_PREFIX}{shape}"));
    let fp = fingerprint(&cmds);
    (json!({"nftables": cmds}), fp, shape)
}

/// The chains whose rules a change of the same shape rewrites in one batch (the kernel layer's
/// rule batches): the firewall's `fw_in` and `fw_out` and the public DNAT chain.
pub const BATCHED_CHAINS: [&str; 3] = [
    super::firewall::rules::CHAIN_IN,
    super::firewall::rules::CHAIN_OUT,
    super::public::NS_DNAT_CHAIN,
];

/// `cmds` without the rules of [`BATCHED_CHAINS`]: what a change of the same shape leaves as it
/// was.
fn without_rule_chains(cmds: &[Value]) -> Vec<Value> {
    cmds.iter()
        .filter(|c| {
            !c["add"]["rule"]["chain"]
                .as_str()
                .is_some_and(|ch| BATCHED_CHAINS.contains(&ch))
        })
        .cloned()
        .collect()
}

fn fingerprint(cmds: &[Value]) -> String {
    let bytes = serde_json::to_vec(cmds).expect("JSON values serialize");
    hex::encode(&Sha256::digest(&bytes)[..8])
}

/// The host ruleset: table `ip <table>` with chain `postrouting` (nat, srcnat) masquerading
/// traffic from the transit range to anywhere outside it, and the guard of the host against its
/// VMs: chain `transit` (filter, prerouting, priority raw, before any DNAT) drops a packet from
/// the transit range to the transit range (a VM reaching another VM's namespace, and through
/// its DNAT the guest, or the host's end of a veth pair, by transit address: VMs reach each
/// other only through public and mesh addresses, where tenants and firewalls apply), and chain
/// `input` (filter, input) drops a packet from the transit range to the host itself (a VM
/// reaching a service of the host on any of its IPv4 addresses).
///
/// Returns the transaction and its fingerprint, written (like [`vm_ruleset`]'s) as the comment
/// of the masquerade rule, so read-back detects a flushed or replaced rule, not only a missing
/// table.
pub fn host_ruleset(table: &str, transit: Ipv4Net) -> (Value, String) {
    let mut cmds = replace_table("ip", table);
    let prefix =
        json!({"prefix": {"addr": transit.network().to_string(), "len": transit.prefix_len()}});
    cmds.push(
        json!({"add": {"chain": {"family": "ip", "table": table, "name": "postrouting",
        "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}}),
    );
    cmds.push(json!({"add": {"rule": {"family": "ip", "table": table, "chain": "postrouting", "expr": [
        {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": prefix.clone()}},
        {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": prefix.clone()}},
        {"masquerade": null}
    ]}}}));
    let from_transit = json!({"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": prefix.clone()}});
    cmds.push(
        json!({"add": {"chain": {"family": "ip", "table": table, "name": "transit",
        "type": "filter", "hook": "prerouting", "prio": -300, "policy": "accept"}}}),
    );
    cmds.push(json!({"add": {"rule": {"family": "ip", "table": table, "chain": "transit", "expr": [
        from_transit.clone(),
        {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": prefix}},
        {"drop": null}
    ]}}}));
    cmds.push(
        json!({"add": {"chain": {"family": "ip", "table": table, "name": "input",
        "type": "filter", "hook": "input", "prio": 0, "policy": "accept"}}}),
    );
    cmds.push(
        json!({"add": {"rule": {"family": "ip", "table": table, "chain": "input", "expr": [
            from_transit,
            {"drop": null}
        ]}}}),
    );
    let fp = fingerprint(&cmds);
    cmds[4]["add"]["rule"]["comment"] = Value::String(format!("{FINGERPRINT_PREFIX}{fp}"));
    (json!({"nftables": cmds}), fp)
}
