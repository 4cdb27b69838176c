//! The VM firewall in the kernel: the conntrack sweep after a table replacement and the
//! audit of a VM's filter table.
//!
//! # Design
//! - The firewall's chains and sets live in the VM's netns table, so they are applied (and
//!   compared by content) with it. Whenever that table is replaced while the firewall filters
//!   (a changed firewall, or a repair of an edited table), the conntrack entries of the VM's
//!   netns that the planned rules would not admit as new connections are deleted right after
//!   the transaction ([`sweep_here`]): such a connection's next packet is new to conntrack and
//!   meets the rules (dropped); a connection the rules admit keeps its entry and goes on
//!   undisturbed. Connections of the netns itself (the metadata service, link-local traffic)
//!   are not the filter's and are kept ([`vmnet_plan::ns::firewall::FirewallPlan::direction`]).
//! - [`audit`] reads one VM's table, compares it with the plan by content and replaces it when
//!   it differs: the agent's firewall audit, cheaper than a full reconcile of the VM. A table
//!   found as planned is not read again while its netns's nf_tables generation stays where it
//!   was then (`gens`): the steady audit is one generation read per VM.
//!
//! # Limitations
//! A conntrack dump walks the kernel's whole hash table (several ms); it is skipped while the
//! VM's netns tracks no connection.

use vmnet_plan::ns::firewall::FirewallPlan;
use vmnet_plan::ns::{VmPlan, names};

use super::driver::NetlinkNsDriver;
use super::{NsError, inns, nftcheck};
use crate::netns;

/// Deletes the conntrack entries of the calling thread's namespace that `fw` would not admit;
/// returns how many. Call it on a thread inside the VM's netns. A failure is logged, not
/// returned: the table is in place, and the next replacement sweeps again.
pub(super) fn sweep_here(netns: &str, fw: &FirewallPlan) -> usize {
    let count = inns::read_sysctls(&["net/netfilter/nf_conntrack_count".to_owned()]);
    if count.first().and_then(Option::as_deref) == Some("0") {
        return 0;
    }
    let swept = crate::conntrack::delete_where(|t| {
        fw.direction(t.orig_src, t.orig_dst, t.reply_src)
            .is_some_and(|(dir, peer)| !fw.admits(dir, peer, t.l4proto, t.orig_dport))
    });
    match swept {
        Ok(n) => {
            if n > 0 {
                tracing::info!(
                    netns,
                    deleted = n,
                    "firewall: removed the tracked connections the rules no longer admit"
                );
            }
            n
        }
        Err(e) => {
            tracing::warn!(netns, error = %e, "firewall: removing the connections the rules no longer admit failed");
            0
        }
    }
}

/// Applies a changed firewall as one rule batch when the VM's table is known to be of the
/// plan's shape at the netns's current generation (see [`super::fwbatch`] and `gens`), then
/// sweeps conntrack; `Ok(false)` when it is not (replace the table whole). A refused batch
/// (nothing committed) is logged and also answers `Ok(false)`.
///
/// # Errors
/// [`NsError`] when the netns cannot be entered for the sweep.
pub(super) fn change_rules(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<bool, NsError> {
    let Some(fw) = &plan.firewall else {
        return Ok(false);
    };
    let table = names::vm_nft_table(&plan.name_prefix);
    let rules = fw.rules();
    // The DNAT rule is rewritten with them: the batch leaves every chain of the table's
    // shape as the plan says.
    let dnat = super::dnatbatch::planned(plan);
    let done = d.nft_gens.change_rules(&plan.netns, plan, |sock| {
        let mut msgs = super::fwbatch::messages(&table, &rules);
        if let Some(dnat) = dnat {
            msgs.extend(super::dnatbatch::messages(&table, dnat));
        }
        sock.transaction(msgs, &format!("replace the firewall rules of {table}"))
    });
    match done {
        Ok(super::gens::RuleChange::Done) => {}
        Ok(super::gens::RuleChange::NotEligible) => return Ok(false),
        Err(e) => {
            tracing::warn!(vm = %plan.vm_id, error = %e, "firewall: the rule batch was refused; replacing the table");
            return Ok(false);
        }
    }
    let name = plan.netns.clone();
    netns::run_in(&plan.netns, || sweep_here(&name, fw))?;
    Ok(true)
}

/// Replaces the VM's netns table with the plan's in one transaction (then sweeps conntrack when
/// the firewall filters), on a thread inside the netns, and remembers the listing read back;
/// records the table as planned at the generation our commit made, when it made exactly one
/// (see `gens`).
pub(super) fn replace_table(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<(), NsError> {
    let table = names::vm_nft_table(&plan.name_prefix);
    let key = nftcheck::key(&plan.netns, "inet", &table);
    let name = plan.netns.clone();
    let memo = &d.nft_memo;
    let gens = &d.nft_gens;
    netns::run_in(&plan.netns, || -> Result<(), NsError> {
        // One libnftables context for the transaction and the read-back: a context costs its
        // set-up and, once it committed, a socket close that waits for the kernel.
        let nft = inns::NftSession::here(&name)?;
        let before = gens.read_here(&name);
        if let Err(e) = nft.json(&plan.nft) {
            gens.forget_sync(&name);
            return Err(e);
        }
        let after = gens.read_here(&name);
        if let Some(fw) = &plan.firewall {
            sweep_here(&name, fw);
        }
        // As read back, the table is this plan's (equal to it, or its remembered form).
        let res = nft.list_table("inet", &table).and_then(|listing| {
            let listing = nftcheck::or_empty(listing);
            memo.after_apply(&name, &key, &plan.nft_fingerprint, &plan.nft, &listing)
        });
        gens.after_commit(&name, plan, before, after, res.is_ok());
        res
    })?
}

/// Compares the VM's netns table with the plan by content and replaces it when it differs;
/// returns the differences replaced (`None` when in sync, or when the netns does not exist:
/// the reconcile pass makes it). A table found as planned at the netns's current nf_tables
/// generation is not listed again (see `gens`).
pub(super) async fn audit(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<Option<Vec<String>>, NsError> {
    let fp = plan.nft_fingerprint.as_str();
    if d.nft_gens.unchanged(&plan.netns, fp) {
        return Ok(None);
    }
    if !netns::exists(&plan.netns) {
        return Ok(None);
    }
    let table = names::vm_nft_table(&plan.name_prefix);
    let key = nftcheck::key(&plan.netns, "inet", &table);
    let name = plan.netns.clone();
    let gens = &d.nft_gens;
    // The generation first: a change after it moves the netns past the one recorded.
    let (generation, listing) = netns::run_in(&plan.netns, || {
        let generation = gens.read_here(&name);
        (generation, inns::list_table(&name, "inet", &table))
    })?;
    let drift = d.nft_memo.drift(
        &plan.netns,
        &key,
        fp,
        &plan.nft,
        &nftcheck::or_empty(listing?),
    )?;
    if drift.is_empty() {
        if let Some(g) = generation {
            gens.found_in_sync(&plan.netns, plan, g);
        }
        return Ok(None);
    }
    // The caller logs the repair with the differences (one line per repair).
    replace_table(d, plan)?;
    Ok(Some(drift))
}
