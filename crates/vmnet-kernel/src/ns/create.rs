//! Creating a VM in one pass (netns, tap, sysctls, nft, veth pair, addresses, routes), and the
//! veth pair alone for a VM whose netns exists.

use std::os::fd::{AsFd, AsRawFd};

use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute, LinkMessage};
use rtnetlink::{Handle, LinkUnspec, LinkVeth};
use vmnet_plan::ns::firewall::FirewallPlan;
use vmnet_plan::ns::firewall::rules::FwRule;
use vmnet_plan::ns::{TapPlan, VethPlan, VmPlan};

use super::apply::sync_routes;
use super::driver::NetlinkNsDriver;
use super::links::configure_fixed;
use super::observe::{self, VmState};
use super::routes::{self, KLink, nl};
use super::{Change, NsError, inns, tc};
use crate::netns;
use crate::nftgen::GenSocket;

/// The ifindex the host veth end is created with (`HOST_INDEX_BASE + uid`, in the host
/// netns), so configuring it needs no lookup; if the host has that index in use already the
/// kernel picks one and the driver looks it up.
const HOST_INDEX_BASE: u32 = 0x3000_0000;

/// The ifindex of the VM's veth end (`PEER_INDEX_BASE + uid`, in the VM's netns). It differs
/// from the host end's on purpose: the kernel takes a link whose index equals its peer's
/// (`iflink`) for one that stacks on nothing, and queues its carrier changes as not urgent.
/// Those are handled at most 100 per second, so creating VMs faster than that piled host ends
/// up on the kernel's global link-watch list (their operstate stuck at `UNKNOWN`), and every
/// later link event walked the pile with interrupts off, holding RTNL.
const PEER_INDEX_BASE: u32 = 0x3800_0000;

/// The second derived pair of bases, tried when the host has the first host index in use
/// (another link took it): `0x3400_0000 + uid` for the host end, `0x3c00_0000 + uid` for the VM
/// end. Only when both host indexes are taken does the kernel pick, and then it picks both.
/// Every base plus the largest user id stays under 2^30.
const SECOND_BASES: (u32, u32) = (0x3400_0000, 0x3c00_0000);

/// The ifindexes a veth pair was created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct VethIndexes {
    /// The host end's, in the host netns.
    pub host: u32,
    /// The VM end's, in the VM's netns.
    pub peer: u32,
}

/// Creates the veth pair of `plan` (the peer made directly inside the VM's netns: `ns`, or the
/// one named `plan.netns` when `None`)
/// with the derived ifindexes (the second pair, [`SECOND_BASES`], when the host has the first
/// host index in use); returns them, or `None` when the host had both host indexes in use and
/// the kernel picked both (the caller then looks the ends up by name). The kernel takes the VM
/// end's index only with the host end's, so kernel-picked indexes could come out equal; in the
/// host netns, whose counter is far past a new netns's, that does not happen in practice.
///
/// The host end is created down and without an automatic IPv6 link-local
/// ([`no_auto_link_local`]); the caller brings it up with its MTU and planned addresses
/// (`configure_fixed`). A host end of that name left by a deferred removal, its peer in a
/// namespace the kernel is still destroying, is deleted first.
pub(super) async fn add_veth(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    v: &VethPlan,
    ns: Option<std::fs::File>,
) -> Result<Option<VethIndexes>, NsError> {
    let fd = match ns {
        Some(f) => f,
        None => netns::open(&plan.netns)?,
    };
    let derived = |(host, peer): (u32, u32)| VethIndexes {
        host: host + plan.user_id,
        peer: peer + plan.user_id,
    };
    let index = derived((HOST_INDEX_BASE, PEER_INDEX_BASE));
    let second = derived(SECOND_BASES);
    let add = |with_index: Option<VethIndexes>| {
        let mut peer = LinkUnspec::new_with_name(&v.peer_name)
            .mtu(v.mtu)
            .address(v.peer_mac.to_vec())
            .setns_by_fd(fd.as_raw_fd());
        // Down until configured: the address generation mode is set while it is down.
        let mut host = LinkVeth::new(&v.host_name, &v.peer_name)
            .mtu(v.mtu)
            .address(v.host_mac.to_vec());
        if let Some(index) = with_index {
            peer = peer.index(index.peer);
            host = host.index(index.host);
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
    match add(Some(index)).await {
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
    let index = match add(Some(index)).await {
        Ok(()) => Some(index),
        // The derived ifindex may be taken on the host by another link: the second derived
        // pair, then the kernel's pick (a taken name fails again and is reported).
        Err(e) if taken(&e) => match add(Some(second)).await {
            Ok(()) => Some(second),
            Err(e) if taken(&e) => add(None).await.map(|()| None).map_err(nl(what()))?,
            Err(e) => return Err(nl(what())(e)),
        },
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
/// none`) while it is still down, so the end carries no IPv6 address: no duplicate address
/// detection work and no local route per VM on the host (the kernel walks the host's IPv6
/// routes on link events). An end left without it (the agent killed between the two
/// requests) is drift, set right by the next apply ([`super::links`]). The kernel refuses the
/// setting in the create request itself, so it is a second one; on an up link the change would
/// notify a link change and with it such a walk. Returns `index`.
///
/// Then reads the end back, for the link-watch side effect explained in the body.
async fn no_auto_link_local(
    d: &NetlinkNsDriver,
    v: &VethPlan,
    index: Option<VethIndexes>,
) -> Result<Option<VethIndexes>, NsError> {
    let mut msg = match index {
        Some(i) => LinkUnspec::new_with_index(i.host).build(),
        None => LinkUnspec::new_with_name(&v.host_name).build(),
    };
    super::links::addr_gen_none(&mut msg);
    d.host
        .link()
        .set(msg)
        .execute()
        .await
        .map_err(nl(format!("host: set {} addrgenmode none", v.host_name)))?;
    // Reading the link makes the kernel handle its pending link-watch event (the carrier turned
    // off at creation) now, while it is down: its operstate becomes `DOWN`. Bringing it up then
    // finds IPv6 not ready on it and skips the walk of every host IPv6 route; the kernel's
    // link-watch work configures IPv6 when the carrier comes on, walking them once per VM
    // instead of twice.
    let read = crate::netlink::link_by_name(&d.host, &v.host_name).await;
    read.map_err(nl(format!("host: get {}", v.host_name)))?;
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
    // One thread names the netns (the spare made after the last create, [`super::spare`], or a
    // new one when there is none) and, inside it, makes the tap, sysctls and a netlink socket.
    // As soon as the namespace is there (a spare at once, a new one once mounted), the veth
    // pair is created from the host side, and the nft table on a second thread inside the
    // netns, concurrently with the rest (nothing reaches the guest before the create returns:
    // no VMM holds the new tap yet).
    // The netns for the veth's VM end: a spare's descriptor at once (before it is named), or
    // `None` once a new netns is mounted (opened by name then).
    let (ns_tx, ns_rx) = tokio::sync::oneshot::channel::<Option<std::fs::File>>();
    let (table_tx, table_rx) = tokio::sync::oneshot::channel::<Result<Generation, NsError>>();
    // What the threads need, made here: a copy of the plan (its nft JSON) costs more than the
    // table's own netlink.
    let p = NetnsWork {
        netns: plan.netns.clone(),
        tap: plan.tap.clone(),
        sysctls: plan.ns_sysctls.clone(),
        guard: super::guard::guard(d, plan)?.map(|(g, p)| (std::sync::Arc::clone(g), p.clone())),
    };
    let t = TableWork::of(plan);
    let spares = std::sync::Arc::clone(&d.spares);
    // The notification sockets of the new netns, opened on its own thread (no thread hop of
    // their own) when the driver watches.
    let watch_cell: std::sync::Arc<std::sync::Mutex<Option<crate::watch::Pair>>> =
        std::sync::Arc::default();
    let cell = d.watcher_on().then(|| std::sync::Arc::clone(&watch_cell));
    let work = tokio::task::spawn_blocking(move || {
        let spare = spares.take();
        let made = spare.as_ref().map(|s| s.fd.as_fd());
        // A spare made with other sysctls gets the plan's written as a new one would.
        let ready = spare.as_ref().is_some_and(|s| s.sysctls == p.sysctls);
        let mut ns_tx = Some(ns_tx);
        if let Some(dup) = spare.as_ref().and_then(|s| s.fd.try_clone().ok())
            && let Some(tx) = ns_tx.take()
        {
            let _ = tx.send(Some(dup.into()));
        }
        netns::name_and_run(&p.netns, made, || -> Result<Made, NsError> {
            if let Some(tx) = ns_tx.take() {
                let _ = tx.send(None);
            }
            if let Some(cell) = cell
                && let Ok(pair) = crate::watch::Pair::open_here()
                && let Ok(mut c) = cell.lock()
            {
                *c = Some(pair);
            }
            // A thread started here lives in the new netns too (it inherits this one's).
            let spawned = std::thread::Builder::new()
                .name("vmnet-nft".into())
                .spawn(move || {
                    let _ = table_tx.send(t.run_here());
                });
            let made = in_new_netns(&p, ready, &rt);
            spawned.map_err(|source| {
                NsError::Netns(netns::NetnsError::Io {
                    name: p.netns.clone(),
                    op: "start the nft thread",
                    source,
                })
            })?;
            made
        })
    });
    let veth = async {
        let Some(v) = &plan.veth else { return Ok(None) };
        let Ok(fd) = ns_rx.await else {
            return Ok(None); // the thread failed before mounting; its error is reported below
        };
        add_veth(d, plan, v, fd).await
    };
    let table = async {
        // No answer: the netns thread failed before starting it; its error is reported.
        table_rx.await.ok().transpose().map(Option::flatten)
    };
    let links = async {
        let (veth, work) = tokio::join!(veth, work);
        let made = work.map_err(|_| {
            NsError::Netns(netns::NetnsError::ThreadPanicked(plan.netns.clone()))
        })???;
        configure(d, plan, &made, veth?).await
    };
    let (links, table) = tokio::join!(links, table);
    // The next VM's namespace, made while this answer goes out.
    d.spares.refill(&plan.ns_sysctls);
    if let Some((sock, at)) = table? {
        d.nft_gens.adopt_created(&plan.netns, sock, at, plan);
    }
    if let Some(pair) = watch_cell.lock().ok().and_then(|mut c| c.take()) {
        d.adopt_watch(&plan.netns, pair);
    }
    links?;
    Ok(vec![Change::CreateVm {
        netns: plan.netns.clone(),
    }])
}

/// Configures what the netns thread and the veth creation made: links, the activity entry,
/// routes, tc.
async fn configure(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    made: &Made,
    veth_index: Option<VethIndexes>,
) -> Result<(), NsError> {
    let ns = &made.ns;
    // What was just made, so configuring it needs no read-back.
    let mut st = VmState::default();
    let known = |name: &str, index, mtu| KLink {
        index,
        name: name.to_owned(),
        mtu,
        up: true,
        mac: None,
        no_auto_link_local: false,
        ipv6_off: false,
    };
    st.ns_links.insert("lo".into(), known("lo", 1, 65536));
    st.ns_links.insert(
        plan.tap.name.clone(),
        known(&plan.tap.name, made.tap_index, plan.tap.mtu),
    );
    if let (Some(v), Some(index)) = (&plan.veth, veth_index) {
        // Created down, with the planned MACs: configuring it brings it up.
        st.host_link = Some(KLink {
            up: false,
            mac: Some(v.host_mac),
            no_auto_link_local: true,
            ..known(&v.host_name, index.host, v.mtu)
        });
        let peer = KLink {
            up: false,
            mac: Some(v.peer_mac),
            ..known(&v.peer_name, index.peer, v.mtu)
        };
        st.ns_links.insert(v.peer_name.clone(), peer);
    }
    let (links, host_link) = configure_fixed(d, plan, ns, &st).await?;
    super::activity::register(d, plan, &links)?;
    // Routes and tc are independent of each other.
    let routes = async {
        let want = observe::resolve(plan, &links, host_link.as_ref(), &d.host).await?;
        let mut ignored = Vec::new();
        sync_routes(d, plan, ns, &want, &st, &mut ignored).await
    };
    // The guest's neighbour entries need only the tap.
    let neighbours = async {
        match links.get(&plan.tap.name) {
            Some(tap) => super::guestneigh::sync(ns, plan, tap.index, &[])
                .await
                .map(drop),
            None => Ok(()),
        }
    };
    futures::try_join!(routes, tc::create(ns, plan, &links), neighbours)?;
    Ok(())
}

/// The kept generation socket of a new netns and the generation at which its table is the
/// plan's (`None` when another commit came between ours).
type Generation = Option<(GenSocket, Option<u32>)>;

/// The nft work of a create, for the thread that does it inside the new netns.
struct TableWork {
    netns: String,
    table: String,
    /// The transaction through libnftables ([`create_body`]): without the firewall's accept
    /// rules when there are `rules`.
    body: String,
    /// The firewall's accept rules, made afterwards as one rule batch ([`super::fwbatch`]).
    rules: Option<Vec<FwRule>>,
}

impl TableWork {
    fn of(plan: &VmPlan) -> Self {
        let rules = plan.firewall.as_ref().map(FirewallPlan::rules);
        Self {
            netns: plan.netns.clone(),
            table: vmnet_plan::ns::names::vm_nft_table(&plan.name_prefix),
            body: create_body(plan, rules.is_some()),
            rules,
        }
    }

    /// Makes the table on a thread inside the new netns: through libnftables, then the
    /// firewall's accept rules as one rule batch (its chains end in `drop` meanwhile: nothing
    /// passes that the plan would not let through). libnftables parses and checks each rule of
    /// its JSON one by one, so a 50-prefix firewall made that way cost a create about 1 ms more.
    /// The generation is read around both over a socket kept for the netns (`None` when it
    /// could not be opened or read: the table is then listed at the next check).
    fn run_here(self) -> Result<Generation, NsError> {
        let mut gen_sock = GenSocket::open_here().ok();
        let before = gen_sock.as_mut().and_then(|s| s.read().ok());
        inns::run_nft_body(&self.netns, &self.body)?;
        let mut commits = 1;
        if let Some(rules) = &self.rules {
            let msgs = super::fwbatch::messages(&self.table, rules);
            let op = format!("add the firewall rules of {}", self.table);
            let sent = match gen_sock.as_mut() {
                Some(s) => s.nfnl().transaction(msgs, &op),
                None => crate::nfnl::NfnlSocket::open().and_then(|mut s| s.transaction(msgs, &op)),
            };
            sent.map_err(|e| NsError::Nft {
                netns: self.netns.clone(),
                message: e.to_string(),
            })?;
            commits += 1;
        }
        let after = gen_sock.as_mut().and_then(|s| s.read().ok());
        // The table is the plan's at `after` when our commits were the only ones.
        Ok(match (gen_sock, before, after) {
            (Some(s), Some(b), Some(a)) => Some((s, (a == b.wrapping_add(commits)).then_some(a))),
            _ => None,
        })
    }
}

/// What the thread in the new netns made.
struct Made {
    /// A netlink socket bound to the netns.
    ns: Handle,
    /// The tap's ifindex.
    tap_index: u32,
}

/// What the thread that creates the netns needs of the plan.
struct NetnsWork {
    netns: String,
    tap: TapPlan,
    sysctls: Vec<(String, String)>,
    /// The guest guard and the VM's entry, when planned.
    guard: Option<(
        std::sync::Arc<crate::guard::GuestGuard>,
        vmnet_plan::ns::guard::GuardPlan,
    )>,
}

/// The work on the thread that just created (or entered) the VM's netns: tap (persistent,
/// owner, MTU, up), lo up and sysctls unless the netns is a spare that has them (`ready`), the
/// guest guard on the tap, and a netlink socket bound to the netns.
fn in_new_netns(w: &NetnsWork, ready: bool, rt: &tokio::runtime::Handle) -> Result<Made, NsError> {
    let tap_err = |op| {
        let name = w.tap.name.clone();
        move |source| NsError::Tap { name, op, source }
    };
    if !ready {
        inns::write_sysctls(&w.netns, &w.sysctls)?;
        inns::link_up("lo", None).map_err(tap_err("set lo up"))?;
    }
    inns::create_tap(&w.tap)?;
    let tap_index = inns::link_up(&w.tap.name, Some(w.tap.mtu)).map_err(tap_err("set mtu/up"))?;
    if let Some((g, p)) = &w.guard {
        super::guard::register_here(g, &w.netns, p)?;
    }
    let _guard = rt.enter();
    let (conn, h, _) = rtnetlink::new_connection().map_err(|source| {
        NsError::Netns(netns::NetnsError::Io {
            name: w.netns.clone(),
            op: "open rtnetlink socket",
            source,
        })
    })?;
    rt.spawn(conn);
    Ok(Made { ns: h, tap_index })
}

/// The create's transaction as `nft -j` input: the plan's without its leading `add table` +
/// `delete table` pair (a fresh netns has no table yet, and a delete makes closing the nft
/// socket slow) and, with `without_accepts`, without the accept rules of the firewall's
/// `fw_in` and `fw_out` (their `drop` kept). Serialized from the plan's commands in place: a
/// copy of a 50-prefix plan's JSON costs more than the transaction's own netlink.
pub(super) fn create_body(plan: &VmPlan, without_accepts: bool) -> String {
    use vmnet_plan::ns::firewall::rules::{CHAIN_IN, CHAIN_OUT};
    #[derive(serde::Serialize)]
    struct Body<'a> {
        nftables: Vec<&'a serde_json::Value>,
    }
    let cmds = plan.nft["nftables"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let prologue = if cmds.len() > 2 && cmds[1].get("delete").is_some() {
        2
    } else {
        0
    };
    let drop_rule = serde_json::json!([{"drop": null}]);
    let nftables = cmds[prologue..]
        .iter()
        .filter(|c| {
            let rule = &c["add"]["rule"];
            !without_accepts
                || !rule["chain"]
                    .as_str()
                    .is_some_and(|ch| ch == CHAIN_IN || ch == CHAIN_OUT)
                || rule["expr"] == drop_rule
        })
        .collect();
    serde_json::to_string(&Body { nftables }).expect("JSON values serialize")
}
