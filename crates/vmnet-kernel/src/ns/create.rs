//! Creating a VM in one pass (netns, tap, sysctls, nft, veth pair, addresses, routes), and the
//! veth pair alone for a VM whose netns exists.

use std::os::fd::AsRawFd;

use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoVeth, LinkAttribute, LinkMessage,
};
use rtnetlink::{Handle, LinkUnspec, LinkVeth};
use vmnet_plan::ns::{VethPlan, VmPlan};

use super::apply::sync_routes;
use super::driver::NetlinkNsDriver;
use super::links::configure_fixed;
use super::observe::{self, VmState};
use super::routes::{self, KLink, nl};
use super::{Change, NsError, inns, tc};
use crate::netns;
use crate::nftgen::GenSocket;

/// The ifindex both veth ends are created with (`IFINDEX_BASE + uid`, on the host and in the VM
/// netns), so configuring them needs no lookup; if the host has that index in use already the
/// kernel picks one and the driver looks it up.
const IFINDEX_BASE: u32 = 0x3000_0000;

/// Creates the veth pair of `plan` (the peer made directly inside the VM's existing netns)
/// with the derived ifindex; returns that index, or `None` when the host had it in use and the
/// kernel picked the indexes (the caller then looks the ends up by name).
///
/// The host end is created down and without an automatic IPv6 link-local
/// ([`no_auto_link_local`]); the caller brings it up with its MTU and planned addresses
/// (`configure_fixed`). A host end of that name left by a deferred removal, its peer in a
/// namespace the kernel is still destroying, is deleted first.
pub(super) async fn add_veth(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    v: &VethPlan,
) -> Result<Option<u32>, NsError> {
    let fd = netns::open(&plan.netns)?;
    let index = IFINDEX_BASE + plan.user_id;
    let add = |with_index: bool| {
        let mut peer = LinkUnspec::new_with_name(&v.peer_name)
            .mtu(v.mtu)
            .setns_by_fd(fd.as_raw_fd());
        // Down until configured: the address generation mode is set while it is down.
        let mut host = LinkVeth::new(&v.host_name, &v.peer_name).mtu(v.mtu);
        if with_index {
            peer = peer.index(index);
            host = host.index(index);
        }
        let mut peer = peer.build();
        one_queue(&mut peer);
        let mut msg = host
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        one_queue(&mut msg);
        d.host.link().add(msg).execute()
    };
    let what = || format!("host: add veth {}/{}", v.host_name, v.peer_name);
    let taken = |e: &rtnetlink::Error| matches!(routes::errno(e), Some(libc::EBUSY | libc::EEXIST));
    match add(true).await {
        Ok(()) => return no_auto_link_local(d, v, Some(index)).await,
        Err(e) if taken(&e) => {}
        Err(e) => return Err(nl(what())(e)),
    }
    // The name (and the derived ifindex with it) may still be held by the host end of this
    // user id's previous veth pair, its peer in a namespace the kernel is still destroying after
    // a deferred removal, or one some process holds. Ours to delete: then try again.
    if d.delete_stale_host_veth(&v.host_name).await? {
        tracing::info!(vm = %plan.vm_id, link = %v.host_name, "deleted a stale host veth end before re-creating it");
    }
    let index = match add(true).await {
        Ok(()) => Some(index),
        // The derived ifindex may be taken on the host by another link: let the kernel pick
        // one (a taken name fails again and is reported).
        Err(e) if taken(&e) => add(false).await.map(|()| None).map_err(nl(what()))?,
        Err(e) => return Err(nl(what())(e)),
    };
    no_auto_link_local(d, v, index).await
}

/// Asks for one transmit and one receive queue on a new veth end. Without them the kernel makes
/// one queue per possible CPU and then cuts the real number down to one on the registered
/// device, waiting for an RCU grace period for each end (`synchronize_rcu_expedited`): about
/// 0.18 ms per pair here. A VM's veth carries one flow of traffic per direction anyway.
fn one_queue(msg: &mut LinkMessage) {
    msg.attributes.push(LinkAttribute::NumTxQueues(1));
    msg.attributes.push(LinkAttribute::NumRxQueues(1));
}

/// Turns off the automatic IPv6 link-local address of the new host veth end (`addrgenmode
/// none`) while it is still down, so the end carries only its planned `fe80::1:<uid>`: no
/// duplicate address detection work and no extra local route per VM on the host (the kernel
/// walks the host's IPv6 routes on link events). The kernel refuses the setting in the create
/// request itself, so it is a second one; on an up link the change would notify a link change
/// and with it such a walk. Returns `index`.
async fn no_auto_link_local(
    d: &NetlinkNsDriver,
    v: &VethPlan,
    index: Option<u32>,
) -> Result<Option<u32>, NsError> {
    let mut msg = match index {
        Some(i) => LinkUnspec::new_with_index(i).build(),
        None => LinkUnspec::new_with_name(&v.host_name).build(),
    };
    msg.attributes
        .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
            vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
        )]));
    d.host
        .link()
        .set(msg)
        .execute()
        .await
        .map_err(nl(format!("host: set {} addrgenmode none", v.host_name)))?;
    Ok(index)
}

/// Creates the VM in one pass; on failure removes whatever was made.
pub(super) async fn create(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    match create_inner(d, plan).await {
        Ok(c) => Ok(c),
        Err(e) => {
            if let Err(r) = d.remove_uid(plan.user_id).await {
                tracing::error!(vm = %plan.vm_id, error = %r, "rolling back a failed create failed");
            }
            Err(e)
        }
    }
}

async fn create_inner(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    let rt = tokio::runtime::Handle::current();
    // One thread creates the netns and, inside it, the tap, sysctls, nft table and a netlink
    // socket. As soon as the namespace is mounted, the veth pair is created from the host side
    // concurrently with the rest of that thread's work.
    let (mounted_tx, mounted_rx) = tokio::sync::oneshot::channel::<()>();
    let p = plan.clone();
    let work = tokio::task::spawn_blocking(move || {
        netns::create_and_run(&p.netns, || -> Result<Made, NsError> {
            let _ = mounted_tx.send(());
            in_new_netns(&p, &rt)
        })
    });
    let veth = async {
        let Some(v) = &plan.veth else { return Ok(None) };
        if mounted_rx.await.is_err() {
            return Ok(None); // the thread failed before mounting; its error is reported below
        }
        add_veth(d, plan, v).await
    };
    let (veth, work) = tokio::join!(veth, work);
    let Made {
        ns,
        tap_index,
        generation,
    } =
        work.map_err(|_| NsError::Netns(netns::NetnsError::ThreadPanicked(plan.netns.clone())))???;
    if let Some((sock, ids)) = generation {
        d.nft_gens.adopt_created(&plan.netns, sock, ids, plan);
    }
    let veth_index = veth?;
    // What was just made, so configuring it needs no read-back.
    let mut st = VmState::default();
    let known = |name: &str, index, mtu| KLink {
        index,
        name: name.to_owned(),
        mtu,
        up: true,
    };
    st.ns_links.insert("lo".into(), known("lo", 1, 65536));
    st.ns_links.insert(
        plan.tap.name.clone(),
        known(&plan.tap.name, tap_index, plan.tap.mtu),
    );
    if let (Some(v), Some(index)) = (&plan.veth, veth_index) {
        // Created down: configuring it brings it up.
        st.host_link = Some(KLink {
            up: false,
            ..known(&v.host_name, index, v.mtu)
        });
        let peer = KLink {
            up: false,
            ..known(&v.peer_name, index, v.mtu)
        };
        st.ns_links.insert(v.peer_name.clone(), peer);
    }
    let (links, host_link) = configure_fixed(d, plan, &ns, &st).await?;
    let want = observe::resolve(plan, &links, host_link.as_ref(), &d.host).await?;
    let mut ignored = Vec::new();
    sync_routes(d, plan, &ns, &want, &st, &mut ignored).await?;
    tc::create(&ns, plan, &links).await?;
    super::activity::install(d, plan, &ns).await?;
    Ok(vec![Change::CreateVm {
        netns: plan.netns.clone(),
    }])
}

/// What the thread in the new netns made.
struct Made {
    /// A netlink socket bound to the netns.
    ns: Handle,
    /// The tap's ifindex.
    tap_index: u32,
    /// An nf_tables generation socket of the netns with the generation read before and after
    /// the table's transaction (`None` when it could not be opened or read: the table is then
    /// listed at the next check, as without one).
    generation: Option<(GenSocket, (u32, u32))>,
}

/// The work on the thread that just created the VM's netns: tap (persistent, owner, MTU, up),
/// lo up, sysctls, the nft table (one transaction, its generation read around it) and a
/// netlink socket bound to the netns.
fn in_new_netns(plan: &VmPlan, rt: &tokio::runtime::Handle) -> Result<Made, NsError> {
    let tap_err = |op| {
        let name = plan.tap.name.clone();
        move |source| NsError::Tap { name, op, source }
    };
    inns::create_tap(&plan.tap)?;
    let tap_index =
        inns::link_up(&plan.tap.name, Some(plan.tap.mtu)).map_err(tap_err("set mtu/up"))?;
    inns::link_up("lo", None).map_err(tap_err("set lo up"))?;
    inns::write_sysctls(&plan.netns, &plan.ns_sysctls)?;
    // A fresh netns has no table yet: skip the replace prologue (a delete makes closing the nft
    // socket slow), keep the rest of the one transaction.
    let mut gen_sock = GenSocket::open_here().ok();
    let before = gen_sock.as_mut().and_then(|s| s.read().ok());
    inns::run_nft(&plan.netns, &without_replace_prologue(&plan.nft))?;
    let after = gen_sock.as_mut().and_then(|s| s.read().ok());
    let generation = match (gen_sock, before, after) {
        (Some(s), Some(b), Some(a)) => Some((s, (b, a))),
        _ => None,
    };
    let _guard = rt.enter();
    let (conn, h, _) = rtnetlink::new_connection().map_err(|source| {
        NsError::Netns(netns::NetnsError::Io {
            name: plan.netns.clone(),
            op: "open rtnetlink socket",
            source,
        })
    })?;
    rt.spawn(conn);
    Ok(Made {
        ns: h,
        tap_index,
        generation,
    })
}

/// The transaction without its leading `add table` + `delete table` pair.
pub(super) fn without_replace_prologue(nft: &serde_json::Value) -> serde_json::Value {
    let mut v = nft.clone();
    if let Some(cmds) = v["nftables"].as_array_mut()
        && cmds.len() > 2
        && cmds[1].get("delete").is_some()
    {
        cmds.drain(..2);
    }
    v
}
