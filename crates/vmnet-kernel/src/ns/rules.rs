//! The host's and a netns's policy rules as the driver compares them (`iif <link> lookup
//! <table> pref <priority>`, IPv6), with conversion to and from netlink messages.

use futures::TryStreamExt;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, IpVersion};

use super::NsError;
use super::routes::nl;
use crate::netlink::errno;

pub(super) use vmnet_plan::ns::diff::KRule;

fn rule_message(r: &KRule) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = AddressFamily::Inet6;
    m.header.action = RuleAction::ToTable;
    if let Ok(t) = u8::try_from(r.table) {
        m.header.table = t;
    }
    m.attributes.push(RuleAttribute::Table(r.table));
    m.attributes.push(RuleAttribute::Priority(r.priority));
    m.attributes.push(RuleAttribute::Iifname(r.iif.clone()));
    m
}

/// The rule of `m` when it has an input interface.
pub(super) fn krule(m: &RuleMessage) -> Option<KRule> {
    let mut table = u32::from(m.header.table);
    let (mut iif, mut priority) = (None, 0);
    for a in &m.attributes {
        match a {
            RuleAttribute::Table(t) => table = *t,
            RuleAttribute::Iifname(n) => iif = Some(n.clone()),
            RuleAttribute::Priority(p) => priority = *p,
            _ => {}
        }
    }
    Some(KRule {
        iif: iif?,
        table,
        priority,
    })
}

/// Dumps the IPv6 rules that have an input interface (each message converted as it arrives).
pub(super) async fn dump_rules(h: &Handle) -> Result<Vec<KRule>, NsError> {
    h.rule()
        .get(IpVersion::V6)
        .execute()
        .try_filter_map(|m| std::future::ready(Ok(krule(&m))))
        .try_collect()
        .await
        .map_err(nl("dump rules"))
}

/// Adds a rule (an identical existing rule is fine).
pub(super) async fn add_rule(h: &Handle, r: &KRule, whereis: &str) -> Result<(), NsError> {
    let mut req = h.rule().add().v6();
    *req.message_mut() = rule_message(r);
    match req.execute().await {
        Ok(()) => Ok(()),
        Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
        Err(e) => Err(nl(format!(
            "{whereis}: add rule iif {} lookup {}",
            r.iif, r.table
        ))(e)),
    }
}

/// Deletes a rule; a rule that is already gone is fine.
pub(super) async fn del_rule(h: &Handle, r: &KRule, whereis: &str) -> Result<(), NsError> {
    match h.rule().del(rule_message(r)).execute().await {
        Ok(()) => Ok(()),
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Ok(()),
        Err(e) => Err(nl(format!(
            "{whereis}: delete rule iif {} lookup {}",
            r.iif, r.table
        ))(e)),
    }
}
