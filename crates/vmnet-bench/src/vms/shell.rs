//! The shell baseline of `vmnet-lab bench vms`: the same per-VM work as the driver, done by forking
//! `ip` and `nft` once per step, built from the same [`VmPlan`].

use std::io::Write as _;
use std::process::{Command, Stdio};

use vmnet_model::Error;
use vmnet_plan::ns::{PlannedRoute, RouteKind, VmPlan};

fn family(dst: &ipnet::IpNet) -> &'static str {
    if matches!(dst, ipnet::IpNet::V4(_)) {
        "-4"
    } else {
        "-6"
    }
}

pub(super) fn route_cmd(ns: &str, r: &PlannedRoute) -> Option<Vec<String>> {
    let mut c: Vec<String> = ["ip", "-n", ns, family(&r.destination), "route", "replace"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    match &r.kind {
        RouteKind::Dev { dev } => c.extend([r.destination.to_string(), "dev".into(), dev.clone()]),
        RouteKind::Via {
            gateway,
            dev,
            onlink,
        } => {
            c.extend([
                r.destination.to_string(),
                "via".into(),
                gateway.to_string(),
                "dev".into(),
                dev.clone(),
            ]);
            if *onlink {
                c.push("onlink".into());
            }
        }
        RouteKind::Throw => c.extend(["throw".into(), r.destination.to_string()]),
        RouteKind::ViaMesh { .. } => return None,
    }
    c.extend(["table".into(), r.table.to_string()]);
    Some(c)
}

/// The commands a shell script runs to set up `plan` with `host_ns` as the host: one process
/// each. The nft ruleset is passed on stdin of the `nft -j -f -` command (the last one).
#[must_use]
pub fn shell_setup(plan: &VmPlan, host_ns: &str) -> Vec<Vec<String>> {
    let ns = plan.netns.as_str();
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<String>>();
    let mtu = plan.tap.mtu.to_string();
    let mut cmds = vec![
        s(&["ip", "netns", "add", ns]),
        s(&["ip", "-n", ns, "link", "set", "lo", "up"]),
    ];
    let mut sysctl = s(&["ip", "netns", "exec", ns, "sysctl", "-q", "-w"]);
    sysctl.extend(plan.ns_sysctls.iter().map(|(k, v)| format!("{k}={v}")));
    sysctl.push("net/ipv6/conf/default/accept_dad=0".into());
    cmds.push(sysctl);
    let tap = plan.tap.name.as_str();
    let mut tuntap = s(&["ip", "-n", ns, "tuntap", "add", "dev", tap, "mode", "tap"]);
    if let Some(u) = plan.tap.owner_uid {
        tuntap.extend(["user".into(), u.to_string()]);
    }
    cmds.push(tuntap);
    cmds.push(s(&[
        "ip",
        "-n",
        ns,
        "addr",
        "add",
        &plan.tap.ipv4.to_string(),
        "dev",
        tap,
    ]));
    cmds.push(s(&[
        "ip",
        "-n",
        ns,
        "addr",
        "add",
        &plan.tap.ipv6_link_local.to_string(),
        "dev",
        tap,
        "nodad",
    ]));
    cmds.push(s(&["ip", "-n", ns, "link", "set", tap, "mtu", &mtu, "up"]));
    if let Some(v) = &plan.veth {
        let (h, p) = (v.host_name.as_str(), v.peer_name.as_str());
        let mac = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        let (host_mac, peer_mac) = (mac(v.host_mac), mac(v.peer_mac));
        cmds.push(s(&[
            "ip", "-n", host_ns, "link", "add", h, "address", &host_mac, "mtu", &mtu, "type",
            "veth", "peer", "name", p, "address", &peer_mac, "mtu", &mtu, "netns", ns,
        ]));
        cmds.push(s(&[
            "ip",
            "-n",
            host_ns,
            "addr",
            "add",
            &v.host_ipv4.to_string(),
            "dev",
            h,
        ]));
        cmds.push(s(&["ip", "-n", host_ns, "link", "set", h, "up"]));
        cmds.push(s(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &v.peer_ipv4.to_string(),
            "dev",
            p,
        ]));
        cmds.push(s(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &v.peer_ipv6_link_local.to_string(),
            "dev",
            p,
            "nodad",
        ]));
        cmds.push(s(&["ip", "-n", ns, "link", "set", p, "up"]));
        // Each side's permanent entry for the other end, as the driver makes them.
        let host_ll = v.host_ipv6_link_local.addr().to_string();
        let peer_ll = v.peer_ipv6_link_local.addr().to_string();
        let entries = [
            (ns, &host_ll, &host_mac, p),
            (host_ns, &peer_ll, &peer_mac, h),
        ];
        for (netns, ip, lladdr, dev) in entries {
            cmds.push(s(&[
                "ip",
                "-n",
                netns,
                "-6",
                "neigh",
                "replace",
                ip,
                "lladdr",
                lladdr,
                "dev",
                dev,
                "nud",
                "permanent",
            ]));
        }
    }
    cmds.extend(plan.ns_routes.iter().filter_map(|r| route_cmd(ns, r)));
    for r in &plan.ns_rules {
        cmds.push(s(&[
            "ip",
            "-n",
            ns,
            "-6",
            "rule",
            "add",
            "iif",
            &r.iif,
            "lookup",
            &r.table.to_string(),
            "pref",
            &r.priority.to_string(),
        ]));
    }
    cmds.extend(
        plan.host_routes
            .iter()
            .filter_map(|r| route_cmd(host_ns, r)),
    );
    for r in &plan.host_rules {
        cmds.push(s(&[
            "ip",
            "-n",
            host_ns,
            "-6",
            "rule",
            "add",
            "iif",
            &r.iif,
            "lookup",
            &r.table.to_string(),
            "pref",
            &r.priority.to_string(),
        ]));
    }
    cmds.extend(tc_cmds(plan));
    cmds.push(s(&["ip", "netns", "exec", ns, "nft", "-j", "-f", "-"]));
    cmds
}

/// The `tc` commands a shell script runs for the plan's throughput limits (what the driver
/// writes over netlink).
fn tc_cmds(plan: &VmPlan) -> Vec<Vec<String>> {
    let ns = plan.netns.as_str();
    let mut cmds = Vec::new();
    for t in &plan.limits.trees {
        let tc = |args: &[&str]| {
            ["ip", "netns", "exec", ns, "tc"]
                .iter()
                .chain(args)
                .map(|a| (*a).to_owned())
                .collect::<Vec<String>>()
        };
        cmds.push(tc(&[
            "qdisc",
            "add",
            "dev",
            &t.dev,
            "root",
            "handle",
            "1:",
            "stab",
            "overhead",
            &t.overhead.to_string(),
            "htb",
            "default",
            "0",
            "direct_qlen",
            &t.direct_qlen.to_string(),
        ]));
        for c in &t.classes {
            cmds.push(tc(&[
                "class",
                "add",
                "dev",
                &t.dev,
                "parent",
                "1:",
                "classid",
                &format!("1:{:x}", c.classid & 0xffff),
                "htb",
                "rate",
                &format!("{}bps", c.rate),
                "ceil",
                &format!("{}bps", c.rate),
                "burst",
                &c.burst.to_string(),
                "quantum",
                &c.quantum.to_string(),
            ]));
        }
        for f in &t.filters {
            let proto = if f.protocol == vmnet_plan::ns::limits::ETH_P_IP {
                "ip"
            } else {
                "ipv6"
            };
            let mut args = vec![
                "filter".to_owned(),
                "add".into(),
                "dev".into(),
                t.dev.clone(),
                "parent".into(),
                "1:".into(),
                "protocol".into(),
                proto.into(),
                "prio".into(),
                f.prio.to_string(),
                "handle".into(),
                format!("::{:x}", f.handle),
                "u32".into(),
            ];
            for k in &f.keys {
                args.extend([
                    "match".into(),
                    "u32".into(),
                    format!("{:#010x}", k.value),
                    format!("{:#010x}", k.mask),
                    "at".into(),
                    k.off.to_string(),
                ]);
            }
            args.extend(["flowid".into(), format!("1:{:x}", f.classid & 0xffff)]);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            cmds.push(tc(&refs));
        }
    }
    cmds
}

/// The commands a shell script runs to remove `plan`'s VM.
#[must_use]
pub fn shell_teardown(plan: &VmPlan, host_ns: &str) -> Vec<Vec<String>> {
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<String>>();
    let mut cmds = Vec::new();
    for r in &plan.host_rules {
        cmds.push(s(&[
            "ip",
            "-n",
            host_ns,
            "-6",
            "rule",
            "del",
            "iif",
            &r.iif,
            "lookup",
            &r.table.to_string(),
            "pref",
            &r.priority.to_string(),
        ]));
    }
    if let Some(v) = &plan.veth {
        cmds.push(s(&["ip", "-n", host_ns, "link", "del", &v.host_name]));
    }
    cmds.push(s(&["ip", "netns", "del", &plan.netns]));
    cmds
}

/// Runs each command in turn (the nft ruleset on the stdin of the `nft` one); fails on the first
/// unsuccessful one with its stderr.
pub(super) fn run_cmds(cmds: &[Vec<String>], nft: Option<&[u8]>) -> Result<(), Error> {
    for c in cmds {
        let is_nft = c.iter().any(|a| a == "nft");
        let mut child = Command::new(&c[0])
            .args(&c[1..])
            .stdin(if is_nft {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::internal(format!("{}: {e}", c.join(" "))))?;
        if let (true, Some(body), Some(mut stdin)) = (is_nft, nft, child.stdin.take()) {
            stdin
                .write_all(body)
                .map_err(|e| Error::internal(format!("{}: {e}", c.join(" "))))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| Error::internal(format!("{}: {e}", c.join(" "))))?;
        if !out.status.success() {
            return Err(Error::internal(format!(
                "`{}` failed: {}",
                c.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    Ok(())
}
