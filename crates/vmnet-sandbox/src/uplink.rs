//! The uplink keeper: the sandbox's own routes on its uplinks, put back after a flap.
//!
//! A link set administratively down loses every route through it, in both families, and its
//! IPv6 addresses unless `net.ipv6.conf.<link>.keep_addr_on_down` is 1. The sandbox sets that
//! sysctl on both ends of each uplink when it builds them ([`crate::sandbox`], [`crate::fleet`]),
//! so the addresses (and with them the kernel's connected routes) come back on `up`. The routes
//! the sandbox added itself (the host's default routes, the fake internet's routes to the hosts)
//! do not: the keeper, `vmnet-lab sandbox-helper uplink`, one per namespace, takes them over.
//!
//! At start it reads the routes of its links in the main table that the kernel did not add
//! itself (`proto kernel`) — the sandbox's, since it starts before any agent — and then listens
//! to the namespace's link events (`RTMGRP_LINK`). After each event it puts every route back
//! with `ip route replace` (a no-op for a route that is there), retrying for a few seconds while
//! a link is still down or its connected route is not back yet. It never deletes a route.

use std::time::Duration;

use serde_json::Value;
use vmnet_model::Error;
use vmnet_model::error::chain;

use crate::netns;

/// How long one pass retries routes that cannot be put back yet.
const RETRY_FOR: Duration = Duration::from_secs(3);

/// The `ip route replace` arguments (after `ip -n NS`) that put back each route of `ip -j
/// [-6] route show dev LINK` output `json` on `link`, leaving out the kernel's own routes.
///
/// # Errors
/// A message when `json` is not that output.
pub fn restore_args(json: &str, family6: bool, link: &str) -> Result<Vec<Vec<String>>, String> {
    let routes: Vec<Value> =
        serde_json::from_str(json).map_err(|e| format!("ip route output: {e}"))?;
    let mut out = Vec::new();
    for r in routes {
        if r["protocol"] == "kernel" || r["type"].as_str().is_some_and(|t| t != "unicast") {
            continue;
        }
        let Some(dst) = r["dst"].as_str() else {
            return Err(format!("ip route output: a route without dst: {r}"));
        };
        let mut a: Vec<String> = Vec::new();
        if family6 {
            a.push("-6".into());
        }
        a.extend(["route".into(), "replace".into(), dst.to_owned()]);
        if let Some(gw) = r["gateway"].as_str() {
            a.extend(["via".into(), gw.to_owned()]);
        }
        a.extend(["dev".into(), link.to_owned()]);
        if let Some(m) = r["metric"].as_u64() {
            a.extend(["metric".into(), m.to_string()]);
        }
        out.push(a);
    }
    Ok(out)
}

/// The routes to keep on `links` in namespace `ns` (see [`restore_args`]).
///
/// # Errors
/// `INTERNAL` when `ip` fails or prints something else.
pub fn snapshot(ns: &str, links: &[String]) -> Result<Vec<Vec<String>>, Error> {
    let mut all = Vec::new();
    for link in links {
        for family6 in [false, true] {
            let mut args = vec!["-j"];
            if family6 {
                args.push("-6");
            }
            args.extend(["route", "show", "dev", link.as_str()]);
            let json = netns::ip(ns, &args)
                .map_err(|e| Error::internal(format!("netns {ns}: {}", chain(&e))))?;
            all.extend(
                restore_args(&json, family6, link)
                    .map_err(|m| Error::internal(format!("netns {ns} {link}: {m}")))?,
            );
        }
    }
    Ok(all)
}

/// Puts every route of `routes` back in `ns`; true when all are there.
fn restore(ns: &str, routes: &[Vec<String>]) -> bool {
    let mut all = true;
    for r in routes {
        let args: Vec<&str> = r.iter().map(String::as_str).collect();
        all &= netns::ip(ns, &args).is_ok();
    }
    all
}

/// Runs the keeper of `links` in namespace `ns` until it is signalled (see the module docs);
/// `ready` is called once it listens.
///
/// # Errors
/// `INTERNAL` when the routes cannot be read or the netlink socket cannot be opened.
pub fn run(
    ns: &str,
    links: &[String],
    ready: impl FnOnce() -> Result<(), Error>,
) -> Result<(), Error> {
    use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
    let routes = snapshot(ns, links)?;
    let sock_err = |e: std::io::Error| Error::internal(format!("netns {ns}: netlink socket: {e}"));
    // A netlink socket belongs to the namespace it was opened in.
    let socket = netns::run_in(ns, || -> std::io::Result<Socket> {
        let mut s = Socket::new(NETLINK_ROUTE)?;
        s.bind(&SocketAddr::new(0, libc::RTMGRP_LINK as u32))?;
        Ok(s)
    })
    .map_err(|e| Error::internal(format!("netns {ns}: {}", chain(&e))))?
    .map_err(sock_err)?;
    for r in &routes {
        eprintln!("keeping: ip -n {ns} {}", r.join(" "));
    }
    ready()?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Any link message, or an overrun (ENOBUFS: messages were lost), is a reason to look.
        match socket.recv(&mut &mut buf[..], 0) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(sock_err(e)),
        }
        let start = std::time::Instant::now();
        while !restore(ns, &routes) && start.elapsed() < RETRY_FOR {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::restore_args;

    #[test]
    fn the_sandbox_routes_are_kept_and_the_kernel_ones_left_out() {
        let v4 = r#"[{"dst":"default","gateway":"203.0.113.1","flags":[]},
                     {"dst":"203.0.113.0/24","protocol":"kernel","scope":"link","prefsrc":"203.0.113.2","flags":[]}]"#;
        assert_eq!(
            restore_args(v4, false, "uplink").unwrap(),
            [[
                "route",
                "replace",
                "default",
                "via",
                "203.0.113.1",
                "dev",
                "uplink"
            ]]
        );
        let v6 = r#"[{"dst":"2001:db8:0:1::/64","protocol":"kernel","metric":256,"flags":[],"pref":"medium"},
                     {"dst":"fdaa::/16","gateway":"2001:db8:0:1::2","metric":1024,"flags":["linkdown"],"pref":"medium"},
                     {"type":"multicast","dst":"ff00::/8","metric":256,"flags":[]},
                     {"dst":"fe80::/64","protocol":"kernel","metric":256,"flags":[]}]"#;
        assert_eq!(
            restore_args(v6, true, "sbhost").unwrap(),
            [[
                "-6",
                "route",
                "replace",
                "fdaa::/16",
                "via",
                "2001:db8:0:1::2",
                "dev",
                "sbhost",
                "metric",
                "1024"
            ]]
        );
        assert_eq!(
            restore_args("[]", true, "x").unwrap(),
            Vec::<Vec<String>>::new()
        );
        assert!(restore_args("not json", false, "x").is_err());
    }
}
