//! The sysctls of a VM netns: forwarding on, and nothing the guest sends can change the
//! namespace's state (design `namespace-mode.md`, "What a VM may send"; the guard drops such
//! frames at the tap already, these settings make the namespace ignore them as well).
//!
//! Each value is set deliberately and read back by drift:
//! - forwarding on (IPv4 and IPv6), no automatic IPv6 link-local on new links;
//! - IPv6: no router advertisement (`accept_ra` 0; a forwarding interface ignores them unless
//!   it is 2), no redirect (`accept_redirects` 0), no routing header (`accept_source_route`
//!   -1), no duplicate address detection on the namespace's addresses (`accept_dad` 0: a guest
//!   answering it could disable the tap's `fe80::1`), no NDP proxying (`proxy_ndp` 0);
//! - IPv4: no redirect (`accept_redirects` 0), no source route (`accept_source_route` 0),
//!   strict reverse-path filtering (`rp_filter` 1: a packet on the tap from a source the tap
//!   does not route to, anything but the guest's /30, is dropped), ARP answered only for an
//!   address of the asking interface (`arp_ignore` 1) and asked with the best local source
//!   (`arp_announce` 2), no neighbour entry made from an unsolicited ARP (`arp_accept` 0), no
//!   proxy ARP (`proxy_arp` 0).
//!
//! The namespace-wide values (`all`, `default`) are written before any link exists, so the tap
//! and the veth end inherit the `default` ones. The kernel combines some of them with the
//! device's own value (the larger, either, or both), so the tap's values that count are read
//! back too ([`tap_sysctls`]) and repaired when changed.
//!
//! Left at the kernel's default on purpose: `drop_gratuitous_arp` and `drop_unsolicited_na`
//! (0). The guard lets through only the guest's announcements of its own addresses with its
//! own MAC, and a guest that boots announces itself that way so a namespace that already tried
//! to reach it learns it at once.

/// The namespace-wide sysctls (`(path under /proc/sys, value)`), written before any link is made
/// in the netns.
#[must_use]
pub fn ns_sysctls() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = [
        ("net/ipv4/ip_forward", "1"),
        ("net/ipv6/conf/all/forwarding", "1"),
        // Links made in the netns after this get no automatic link-local (the tap and the
        // VM end carry only their planned ones): no duplicate address detection and no
        // multicast listener reports for addresses nothing uses.
        ("net/ipv6/conf/default/addr_gen_mode", "1"),
        ("net/ipv6/conf/all/proxy_ndp", "0"),
        ("net/ipv4/conf/all/arp_ignore", "1"),
        ("net/ipv4/conf/all/arp_announce", "2"),
        ("net/ipv4/conf/all/arp_accept", "0"),
        ("net/ipv4/conf/all/proxy_arp", "0"),
    ]
    .into_iter()
    .map(|(p, v)| (p.to_owned(), v.to_owned()))
    .collect();
    for scope in ["all", "default"] {
        for (key, value) in [
            ("ipv6/conf/{}/accept_ra", "0"),
            ("ipv6/conf/{}/accept_redirects", "0"),
            ("ipv6/conf/{}/accept_source_route", "-1"),
            ("ipv6/conf/{}/accept_dad", "0"),
            ("ipv4/conf/{}/accept_redirects", "0"),
            ("ipv4/conf/{}/accept_source_route", "0"),
            ("ipv4/conf/{}/rp_filter", "1"),
        ] {
            out.push((
                format!("net/{}", key.replace("{}", scope)),
                value.to_owned(),
            ));
        }
    }
    out
}

/// The tap's own values that count (read back and repaired): forwarding, router
/// advertisements, redirects, duplicate address detection, NDP and ARP proxying, unsolicited
/// ARP and reverse-path filtering on `tap`.
#[must_use]
pub fn tap_sysctls(tap: &str) -> Vec<(String, String)> {
    [
        ("ipv6", "forwarding", "1"),
        ("ipv6", "accept_ra", "0"),
        ("ipv6", "accept_redirects", "0"),
        ("ipv6", "accept_dad", "0"),
        ("ipv6", "proxy_ndp", "0"),
        ("ipv4", "forwarding", "1"),
        ("ipv4", "accept_redirects", "0"),
        ("ipv4", "rp_filter", "1"),
        ("ipv4", "proxy_arp", "0"),
        ("ipv4", "arp_accept", "0"),
    ]
    .into_iter()
    .map(|(family, key, value)| (format!("net/{family}/conf/{tap}/{key}"), value.to_owned()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_is_set_once_for_all_and_default() {
        let ns = ns_sysctls();
        let paths: std::collections::BTreeSet<&str> = ns.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths.len(), ns.len(), "no path twice");
        for scope in ["all", "default"] {
            for k in ["accept_ra", "accept_redirects", "accept_dad"] {
                let p = format!("net/ipv6/conf/{scope}/{k}");
                assert!(ns.contains(&(p.clone(), "0".into())), "{p}");
            }
            let rp = format!("net/ipv4/conf/{scope}/rp_filter");
            assert!(ns.contains(&(rp, "1".into())));
        }
        let tap = tap_sysctls("vmnt0007");
        assert!(tap.contains(&("net/ipv6/conf/vmnt0007/accept_ra".into(), "0".into())));
        assert!(tap.iter().all(|(p, _)| p.contains("/vmnt0007/")));
    }
}
