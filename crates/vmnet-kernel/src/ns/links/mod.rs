//! The VM's links, repaired in place: a missing tap is made again inside the existing netns, a
//! veth pair missing (or missing one end) is made again between the host and the existing netns,
//! a veth pair the plan no longer has is deleted, and MTU, up state and addresses are brought to
//! the plan (stale addresses removed), and so are the veth ends' MACs and the permanent
//! neighbour entries between them ([`neigh`]). IPv6 turned off on one of the links
//! (`disable_ipv6`, which only a sysctl can change) is turned on again, before its addresses.
//! Nothing here deletes the netns or a tap that exists, so a VMM holding the tap keeps it
//! across every repair.

use std::collections::HashSet;
use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, LinkAttribute, LinkMessage,
};
use rtnetlink::{Handle, LinkUnspec};
use vmnet_plan::ns::{NameKind, VmPlan};

use super::create::add_veth;
use super::driver::NetlinkNsDriver;
use super::observe::{KAddr, VmState};
use super::routes::{self, KLink, nl};
use super::{Change, NsError, Side, inns};
use crate::netns;

pub(super) mod neigh;
use neigh::KNeigh;

/// A link of the VM that is missing, half there, or not planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkFix {
    /// The tap is missing: make it again in the netns.
    Tap,
    /// The planned veth pair is missing: make it.
    AddVeth,
    /// One end of the planned pair is missing: delete the other, make the pair again.
    HalfVeth {
        /// Whether the end left is the host end (else the netns end).
        host_left: bool,
    },
    /// The plan has no veth pair (no mesh address) but the kernel has one end or both.
    DelVeth,
}

/// The link fixes `st` needs to match `plan`, in the order they are made.
pub(super) fn link_fixes(plan: &VmPlan, st: &VmState) -> Vec<LinkFix> {
    let mut out = Vec::new();
    if !st.ns_links.contains_key(&plan.tap.name) {
        out.push(LinkFix::Tap);
    }
    let peer = vmnet_plan::ns::name(&plan.name_prefix, NameKind::PeerVeth, plan.user_id);
    let (host, peer) = (st.host_link.is_some(), st.ns_links.contains_key(&peer));
    match (plan.veth.is_some(), host, peer) {
        (true, true, true) | (false, false, false) => {}
        (true, false, false) => out.push(LinkFix::AddVeth),
        (true, host_left, _) => out.push(LinkFix::HalfVeth { host_left }),
        (false, ..) => out.push(LinkFix::DelVeth),
    }
    out
}

impl LinkFix {
    /// The change this fix makes, as reported by apply and drift.
    pub(super) fn change(self, plan: &VmPlan) -> Change {
        let p = &plan.name_prefix;
        let host = vmnet_plan::ns::name(p, NameKind::HostVeth, plan.user_id);
        let peer = vmnet_plan::ns::name(p, NameKind::PeerVeth, plan.user_id);
        match self {
            Self::Tap => Change::Repair {
                what: format!("{}: tap {} missing, made again", plan.netns, plan.tap.name),
            },
            Self::AddVeth => Change::AddVeth { host, peer },
            Self::HalfVeth { host_left } => Change::Repair {
                what: format!(
                    "{}: veth {host}/{peer} lost its {} end, made again",
                    plan.netns,
                    if host_left { "netns" } else { "host" }
                ),
            },
            Self::DelVeth => Change::DelVeth { host },
        }
    }
}

/// Deletes link `index` through `h`; a link already gone is fine.
async fn del_link(h: &Handle, index: u32, what: String) -> Result<(), NsError> {
    match h.link().del(index).execute().await {
        Ok(()) => Ok(()),
        Err(e) if routes::errno(&e) == Some(libc::ENODEV) => Ok(()),
        Err(e) => Err(nl(what)(e)),
    }
}

/// Makes the link fixes `st` needs, in place; returns the changes (empty when the links were
/// all there). The caller observes again afterwards: routes through a re-made link are gone.
pub(super) async fn repair_links(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    st: &VmState,
) -> Result<Vec<Change>, NsError> {
    let mut changes = Vec::new();
    let w = plan.netns.as_str();
    let peer = vmnet_plan::ns::name(&plan.name_prefix, NameKind::PeerVeth, plan.user_id);
    let del_host = || async {
        match &st.host_link {
            Some(l) => del_link(&d.host, l.index, format!("host: delete link {}", l.name)).await,
            None => Ok(()),
        }
    };
    let del_peer = || async {
        match st.ns_links.get(&peer) {
            Some(l) => del_link(ns, l.index, format!("{w}: delete link {peer}")).await,
            None => Ok(()),
        }
    };
    for fix in link_fixes(plan, st) {
        tracing::warn!(vm = %plan.vm_id, change = %fix.change(plan), "repairing links in place");
        match (fix, &plan.veth) {
            (LinkFix::Tap, _) => {
                let tap = plan.tap.clone();
                netns::run_in(&plan.netns, move || -> Result<u32, NsError> {
                    inns::create_tap(&tap)?;
                    inns::link_up(&tap.name, Some(tap.mtu)).map_err(|source| NsError::Tap {
                        name: tap.name.clone(),
                        op: "set mtu/up",
                        source,
                    })
                })??;
            }
            (LinkFix::AddVeth, Some(v)) => {
                add_veth(d, plan, v, None).await?;
            }
            (LinkFix::HalfVeth { host_left }, Some(v)) => {
                if host_left {
                    del_host().await?;
                } else {
                    del_peer().await?;
                }
                add_veth(d, plan, v, None).await?;
            }
            (LinkFix::DelVeth, _) => {
                // Deleting one end deletes its peer; delete both in case they are not a pair.
                del_host().await?;
                del_peer().await?;
            }
            (LinkFix::AddVeth | LinkFix::HalfVeth { .. }, None) => {
                return Err(NsError::Invalid(format!(
                    "vm {}: a veth fix for a plan without a veth pair",
                    plan.vm_id
                )));
            }
        }
        changes.push(fix.change(plan));
    }
    Ok(changes)
}

/// One link of the VM as planned: where, its name, MTU, the addresses it carries (the tap
/// three: its /30, `fe80::1/64` and the metadata /32; the netns veth end its transit address
/// and `fe80::2/64`; the host end only its transit address), its MAC when planned (the veth
/// ends') and the permanent neighbour entry it keeps for the other end (the veth ends).
struct LinkSpec<'a> {
    side: Side,
    name: &'a str,
    mtu: u32,
    addrs: Vec<(IpAddr, u8)>,
    mac: Option<[u8; 6]>,
    neigh: Option<(IpAddr, [u8; 6])>,
    /// Whether the kernel must make no IPv6 link-local on it (every link vmnet makes: each
    /// carries only its planned link-local, if any).
    no_auto_link_local: bool,
}

fn link_specs(plan: &VmPlan) -> Vec<LinkSpec<'_>> {
    let mut out = vec![LinkSpec {
        side: Side::Vm,
        name: &plan.tap.name,
        mtu: plan.tap.mtu,
        addrs: vec![
            (IpAddr::V4(plan.tap.ipv4.addr()), plan.tap.ipv4.prefix_len()),
            (
                IpAddr::V6(plan.tap.ipv6_link_local.addr()),
                plan.tap.ipv6_link_local.prefix_len(),
            ),
            (
                IpAddr::V4(plan.tap.metadata_ipv4.addr()),
                plan.tap.metadata_ipv4.prefix_len(),
            ),
        ],
        mac: None,
        neigh: None,
        no_auto_link_local: true,
    }];
    if let Some(v) = &plan.veth {
        out.push(LinkSpec {
            side: Side::Vm,
            name: &v.peer_name,
            mtu: v.mtu,
            addrs: vec![
                (IpAddr::V4(v.peer_ipv4.addr()), v.peer_ipv4.prefix_len()),
                (
                    IpAddr::V6(v.peer_ipv6_link_local.addr()),
                    v.peer_ipv6_link_local.prefix_len(),
                ),
            ],
            mac: Some(v.peer_mac),
            neigh: Some((IpAddr::V6(v.host_ipv6_link_local.addr()), v.host_mac)),
            no_auto_link_local: true,
        });
        out.push(LinkSpec {
            side: Side::Host,
            name: &v.host_name,
            mtu: v.mtu,
            addrs: vec![(IpAddr::V4(v.host_ipv4.addr()), v.host_ipv4.prefix_len())],
            mac: Some(v.host_mac),
            neigh: Some((IpAddr::V6(v.peer_ipv6_link_local.addr()), v.peer_mac)),
            no_auto_link_local: true,
        });
    }
    out
}

/// What `st` has of the link `spec` names: the link, the addresses seen on its side and the
/// neighbour entry seen for the address `spec.neigh` names (looked up on that link only).
fn find<'a>(
    st: &'a VmState,
    spec: &LinkSpec<'_>,
) -> (Option<&'a KLink>, &'a HashSet<KAddr>, Option<KNeigh>) {
    match spec.side {
        Side::Vm => (
            st.ns_links.get(spec.name),
            &st.ns_addrs,
            st.ns_neigh.filter(|_| spec.neigh.is_some()),
        ),
        Side::Host => (
            st.host_link.as_ref().filter(|l| l.name == spec.name),
            &st.host_addrs,
            st.host_neigh,
        ),
    }
}

/// Addresses on link `spec.name` (ifindex `index`) that the plan does not put there: every
/// IPv4 address; on the host end every IPv6 address too (it carries none, and the kernel adds
/// none: `addrgenmode none`; e.g. the `fe80::1:<uid>` it carried before that plan); in the netns
/// every IPv6 address too on a link with `addrgenmode none` (a link-local the kernel made
/// before the mode was set, e.g. an EUI-64 one), and otherwise IPv6 addresses outside the
/// link-local range and a planned link-local with another prefix length (the kernel does not
/// change the prefix length of an existing address).
fn stale(have: &HashSet<KAddr>, index: u32, spec: &LinkSpec<'_>) -> Vec<(IpAddr, u8)> {
    let want = &spec.addrs;
    let mut out: Vec<(IpAddr, u8)> = have
        .iter()
        .filter(|(i, a, p)| {
            *i == index
                && !want.contains(&(*a, *p))
                && match (a, spec.side) {
                    (IpAddr::V4(_), _) | (IpAddr::V6(_), Side::Host) => true,
                    (IpAddr::V6(v6), Side::Vm) => {
                        spec.no_auto_link_local
                            || !v6.is_unicast_link_local()
                            || want.iter().any(|(w, _)| w == a)
                    }
                }
        })
        .map(|(_, a, p)| (*a, *p))
        .collect();
    out.sort_unstable();
    out
}

/// The fixed per-VM state that is wrong (MTU, up, addresses missing or stale, lo, sysctls), if
/// any.
pub(super) fn fixed_drift(plan: &VmPlan, st: &VmState) -> Option<String> {
    let mut bad = Vec::new();
    for spec in link_specs(plan) {
        // The report names the VM's netns; the host end of the veth pair is in the host.
        let name = match spec.side {
            Side::Host => format!("host {}", spec.name),
            Side::Vm => spec.name.to_owned(),
        };
        match find(st, &spec) {
            (Some(l), addrs, neigh) if l.mtu == spec.mtu && l.up => {
                if spec
                    .addrs
                    .iter()
                    .any(|(a, p)| !addrs.contains(&(l.index, *a, *p)))
                {
                    bad.push(format!("{name} addresses"));
                }
                let old = stale(addrs, l.index, &spec);
                if !old.is_empty() {
                    let list: Vec<String> = old.iter().map(|(a, p)| format!("{a}/{p}")).collect();
                    bad.push(format!("{name} stale addresses {}", list.join(" ")));
                }
                if spec.mac.is_some_and(|m| l.mac != Some(m)) {
                    bad.push(format!("{name} mac"));
                }
                if spec.no_auto_link_local && !l.no_auto_link_local {
                    bad.push(format!("{name} addrgenmode"));
                }
                if l.ipv6_off {
                    bad.push(format!("{name} disable_ipv6"));
                }
                if let Some((ip, mac)) = spec.neigh
                    && !neigh.is_some_and(|n| n.is_permanent_for(mac))
                {
                    bad.push(format!("{name} neighbour {ip}"));
                }
            }
            _ => bad.push(format!("{name} mtu/up")),
        }
    }
    if !st.ns_links.get("lo").is_some_and(|l| l.up) {
        bad.push("lo up".into());
    }
    if !st.sysctls_bad.is_empty() {
        bad.push(format!("sysctls {}", st.sysctls_bad.join(", ")));
    }
    (!bad.is_empty()).then(|| format!("{}: {}", plan.netns, bad.join("; ")))
}

/// Brings lo, the tap and the veth ends to the planned MTU, MAC, up, addresses and neighbour
/// entries (idempotent; stale addresses are removed first). The netns links are configured
/// concurrently (independent netlink requests), the host end after them: brought up while its
/// peer is up, it gets its carrier at once, and the kernel's link-watch work configures it for
/// IPv6 right after (its `ff00::/8` route is then deleted, [`neigh`]). Measured against
/// configuring it beside the netns links or before them, this order gave the lowest PUT
/// median. Returns the netns links by name and the host veth.
pub(super) async fn configure_fixed(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    st: &VmState,
) -> Result<(std::collections::HashMap<String, KLink>, Option<KLink>), NsError> {
    let w = plan.netns.as_str();
    let lo = async {
        if st.ns_links.get("lo").is_some_and(|l| l.up) {
            return Ok(());
        }
        ns.link()
            .set(LinkUnspec::new_with_index(1).up().build())
            .execute()
            .await
            .map_err(nl(format!("{w}: set lo up")))
    };
    let specs = link_specs(plan);
    let ensure = |side: Side| {
        futures::future::try_join_all(specs.iter().filter(move |s| s.side == side).map(|spec| {
            let (h, label) = match spec.side {
                Side::Vm => (ns, w),
                Side::Host => (&d.host, "host"),
            };
            let (at, dumps) = match spec.side {
                Side::Vm => (SysctlNs::Vm(w), None),
                Side::Host => (SysctlNs::Host(&d.host_ns), Some(&d.host_dumps)),
            };
            ensure_link(h, spec, find(st, spec), label, at, dumps)
        }))
    };
    let ((), mut links) = futures::try_join!(lo, ensure(Side::Vm))?;
    links.extend(ensure(Side::Host).await?);
    let mut ns_links = std::collections::HashMap::new();
    let mut host = None;
    for (spec, l) in specs.iter().zip(links) {
        match spec.side {
            Side::Vm => {
                ns_links.insert(l.name.clone(), l);
            }
            Side::Host => host = Some(l),
        }
    }
    Ok((ns_links, host))
}

/// The netns whose sysctls hold a link's settings.
enum SysctlNs<'a> {
    /// The VM's netns, by name.
    Vm(&'a str),
    /// The host's.
    Host(&'a super::host::HostNs),
}

/// Turns IPv6 back on for `link` (`disable_ipv6` = 0): the kernel configures it again at once
/// (the host end gets no link-local: its `addrgenmode none` stays).
fn ipv6_on(at: &SysctlNs<'_>, link: &str) -> Result<(), NsError> {
    let s = [(format!("net/ipv6/conf/{link}/disable_ipv6"), "0".to_owned())];
    match at {
        SysctlNs::Vm(n) => netns::run_in(n, || inns::write_sysctls(n, &s))?,
        SysctlNs::Host(h) => h.run(|| inns::write_sysctls(h.label(), &s))?,
    }
}

/// Makes link `spec.name` have its MTU, be up and carry exactly its planned addresses (of the
/// kinds [`stale`] considers); returns it. `dumps` is held for a dump over `h` when `h` is
/// shared with other VMs' applies (the host's: one dump at a time per socket).
async fn ensure_link(
    h: &Handle,
    spec: &LinkSpec<'_>,
    (known, have, neigh): (Option<&KLink>, &HashSet<KAddr>, Option<KNeigh>),
    w: &str,
    at: SysctlNs<'_>,
    dumps: Option<&tokio::sync::Mutex<()>>,
) -> Result<KLink, NsError> {
    let name = spec.name;
    let mut l = match known {
        Some(l) => l.clone(),
        None => routes::link_by_name(h, name)
            .await?
            .ok_or_else(|| NsError::Missing(format!("{w}: link {name} is missing")))?,
    };
    let old = stale(have, l.index, spec);
    if !old.is_empty() {
        del_addrs(h, l.index, &old, w, dumps).await?;
    }
    if spec.no_auto_link_local && !l.no_auto_link_local {
        // Before the up when it is down, so the kernel makes no link-local on the way.
        let mut msg = LinkUnspec::new_with_index(l.index).build();
        addr_gen_none(&mut msg);
        h.link()
            .set(msg)
            .execute()
            .await
            .map_err(nl(format!("{w}: set {name} addrgenmode none")))?;
        l.no_auto_link_local = true;
    }
    // IPv6 turned off by hand: the kernel drops the VM's IPv6 there and refuses addresses. On
    // after `addrgenmode none`, so the host end gets no link-local on the way.
    let ipv6_was_off = l.ipv6_off;
    if ipv6_was_off {
        ipv6_on(&at, name)?;
        l.ipv6_off = false;
    }
    let mac = spec.mac.filter(|m| l.mac != Some(*m));
    let was_up = l.up;
    if l.mtu != spec.mtu || !l.up || mac.is_some() {
        let mut set = LinkUnspec::new_with_index(l.index).mtu(spec.mtu).up();
        if let Some(m) = mac {
            set = set.address(m.to_vec());
        }
        h.link()
            .set(set.build())
            .execute()
            .await
            .map_err(nl(format!("{w}: set {name} mtu/mac/up")))?;
        l.mtu = spec.mtu;
        l.up = true;
        l.mac = spec.mac.or(l.mac);
    }
    // Brought up now, or carrying addresses from an older plan: its multicast route goes.
    if spec.side == Side::Host && (!was_up || !old.is_empty() || ipv6_was_off) {
        neigh::drop_multicast_route(h, l.index, name);
    }
    futures::future::try_join_all(spec.addrs.iter().map(|a| add_addr(h, have, l.index, *a, w)))
        .await?;
    // After the up: taking a link down flushes its entries, permanent ones included.
    if let Some((ip, mac)) = spec.neigh
        && (!was_up || !neigh.is_some_and(|n| n.is_permanent_for(mac)))
    {
        neigh::set(h, l.index, name, ip, mac, w).await?;
    }
    Ok(l)
}

/// Adds `addrgenmode none` (no automatic IPv6 link-local) to a link request.
pub(super) fn addr_gen_none(msg: &mut LinkMessage) {
    msg.attributes
        .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
            vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
        )]));
}

/// Deletes the addresses `gone` from link `index` (as the kernel lists them); the dump holds
/// `dumps` when given.
async fn del_addrs(
    h: &Handle,
    index: u32,
    gone: &[(IpAddr, u8)],
    w: &str,
    dumps: Option<&tokio::sync::Mutex<()>>,
) -> Result<(), NsError> {
    let held = match dumps {
        Some(m) => Some(m.lock().await),
        None => None,
    };
    let msgs: Vec<_> = crate::ns::routes::addr_dump(h, index)
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("{w}: dump addresses of #{index}")))?;
    drop(held);
    for m in msgs.into_iter().filter(|m| m.header.index == index) {
        let Some(ip) = m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        }) else {
            continue;
        };
        let plen = m.header.prefix_len;
        if !gone.contains(&(ip, plen)) {
            continue;
        }
        match h.address().del(m).execute().await {
            Ok(()) => {}
            Err(e) if matches!(routes::errno(&e), Some(libc::EADDRNOTAVAIL | libc::ENODEV)) => {}
            Err(e) => {
                return Err(nl(format!("{w}: delete address {ip}/{plen} on #{index}"))(
                    e,
                ));
            }
        }
    }
    Ok(())
}

/// Adds an address unless `have` lists it; IPv6 without duplicate address detection, so it is
/// usable at once.
async fn add_addr(
    h: &Handle,
    have: &HashSet<KAddr>,
    index: u32,
    (ip, plen): (IpAddr, u8),
    w: &str,
) -> Result<(), NsError> {
    if have.contains(&(index, ip, plen)) {
        return Ok(());
    }
    let mut req = h.address().add(index, ip, plen).replace();
    if ip.is_ipv6() {
        let m = req.message_mut();
        m.header.flags = AddressHeaderFlags::Nodad;
        m.attributes
            .retain(|a| !matches!(a, AddressAttribute::Flags(_)));
        m.attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    req.execute()
        .await
        .map_err(nl(format!("{w}: add address {ip}/{plen} on #{index}")))
}

#[cfg(test)]
mod tests;
