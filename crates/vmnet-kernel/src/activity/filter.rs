//! The activity filter on one device: read back over rtnetlink, written with aya; device
//! indexes.

use std::fmt;

use futures::StreamExt;
use rtnetlink::Handle;
use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{
    TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle as NlHandle, TcMessage, TcOption,
};
use vmnet_plan::ns::activity::ActivityPlan;

use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{SchedClassifier, TcAttachType};

use super::ActivityError;

/// The clsact egress parent (`TC_H_CLSACT | TC_H_MIN_EGRESS`).
const CLSACT_EGRESS: u32 = 0xffff_fff3;

/// The filter found at the plan's priority and handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedFilter {
    /// The classifier kind (`bpf` for ours).
    pub kind: String,
    /// The program id it runs, if a bpf filter.
    pub prog_id: Option<u32>,
    /// The program name the filter reports.
    pub prog_name: Option<String>,
    /// Whether it runs in direct-action mode.
    pub direct_action: bool,
}

impl ObservedFilter {
    /// Whether this is a direct-action bpf filter running program `id`.
    #[must_use]
    pub fn is_program(&self, id: u32) -> bool {
        self.kind == "bpf" && self.direct_action && self.prog_id == Some(id)
    }

    /// Whether this is a direct-action bpf filter running a program named as ours
    /// ([`vmnet_plan::ns::activity::PROGRAM`]), whatever its id: the activity program an
    /// earlier agent loaded.
    #[must_use]
    pub fn is_activity_program(&self) -> bool {
        self.kind == "bpf"
            && self.direct_action
            && self.prog_name.as_deref() == Some(vmnet_plan::ns::activity::PROGRAM)
    }
}

impl fmt::Display for ObservedFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(id) = self.prog_id {
            write!(f, " program {id}")?;
        }
        if let Some(n) = &self.prog_name {
            write!(f, " ({n})")?;
        }
        if !self.direct_action {
            write!(f, " without direct-action")?;
        }
        Ok(())
    }
}

fn parse(m: &TcMessage) -> ObservedFilter {
    let mut out = ObservedFilter {
        kind: String::new(),
        prog_id: None,
        prog_name: None,
        direct_action: false,
    };
    for a in &m.attributes {
        match a {
            TcAttribute::Kind(k) => out.kind.clone_from(k),
            TcAttribute::Options(opts) => {
                for o in opts {
                    match o {
                        TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => out.prog_id = Some(*id),
                        TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => {
                            out.prog_name = Some(n.clone());
                        }
                        TcOption::Bpf(TcFilterBpfOption::Flags(f)) => {
                            out.direct_action = f.contains(TcBpfFlags::DirectAction);
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The filter at `plan`'s priority and handle on the egress of `plan.dev` (in the namespace of
/// `ns`), `None` when there is none (or no clsact qdisc).
pub(super) async fn observe(
    netns: &str,
    ns: &Handle,
    plan: &ActivityPlan,
) -> Result<Option<ObservedFilter>, ActivityError> {
    let no_dev = || ActivityError::NoDevice {
        netns: netns.to_owned(),
        dev: plan.dev.clone(),
    };
    let obs = |source| ActivityError::Observe {
        netns: netns.to_owned(),
        dev: plan.dev.clone(),
        source,
    };
    let link = crate::netlink::link_by_name(ns, &plan.dev)
        .await
        .map_err(obs)?
        .ok_or_else(no_dev)?;
    let mut msg = TcMessage::with_index(i32::try_from(link.header.index).unwrap_or(i32::MAX));
    msg.header.parent = NlHandle::from(CLSACT_EGRESS);
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetTrafficFilter(msg));
    req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut h = ns.clone();
    let mut resp = h.request(req).map_err(obs)?;
    let mut found = None;
    while let Some(r) = resp.next().await {
        match r.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewTrafficFilter(m)) => {
                let prio = u16::try_from(m.header.info >> 16).unwrap_or(0);
                if prio == plan.priority
                    && u32::from(m.header.handle) == plan.handle
                    && found.is_none()
                {
                    found = Some(parse(&m));
                }
            }
            // No clsact qdisc on the device: no filter.
            NetlinkPayload::Error(e) if e.code.is_some() => {
                let code = e.code.map_or(0, |c| -c.get());
                if code == libc::EINVAL || code == libc::ENOENT {
                    return Ok(None);
                }
                return Err(obs(rtnetlink::Error::NetlinkError(e)));
            }
            _ => {}
        }
    }
    Ok(found)
}

/// Writes `prog` as `plan`'s filter on the egress of `plan.dev` in the current thread's
/// namespace, replacing one already at our priority and handle, and leaves it attached when the
/// program object goes (the kernel keeps it with the device).
pub(super) fn attach(
    prog: &mut SchedClassifier,
    plan: &ActivityPlan,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let handle = TcHandle::from(plan.handle);
    let dev = plan.dev.as_str();
    // An existing clsact qdisc (an earlier agent, other tools) is fine.
    let _ = aya::programs::tc::qdisc_add_clsact(dev);
    let opts = TcAttachOptions::Netlink(NlOptions {
        priority: plan.priority,
        handle,
        ..NlOptions::default()
    });
    let id = match prog.attach_with_options(dev, TcAttachType::Egress, opts) {
        Ok(id) => id,
        Err(first) => {
            let old = SchedClassifierLink::attached(
                dev,
                TcAttachType::Egress,
                plan.priority,
                handle,
                None,
            )?;
            prog.attach_to_link(old)
                .map_err(|e| format!("{first}; replacing: {e}"))?
        }
    };
    let link = prog.take_link(id)?;
    // Released, not detached: the filter stays when this process exits.
    std::mem::forget(link);
    Ok(())
}

/// The ifindex of device `dev` in `netns` (rtnetlink handle `ns`).
pub(super) async fn ifindex(netns: &str, ns: &Handle, dev: &str) -> Result<u32, ActivityError> {
    crate::netlink::link_by_name(ns, dev)
        .await
        .map_err(|source| ActivityError::Observe {
            netns: netns.to_owned(),
            dev: dev.to_owned(),
            source,
        })?
        .map(|l| l.header.index)
        .ok_or_else(|| ActivityError::NoDevice {
            netns: netns.to_owned(),
            dev: dev.to_owned(),
        })
}

/// Deletes the filter running our program from the egress of `plan.dev` (current thread's
/// namespace); `Ok(false)` when there was none.
pub(super) fn detach(
    plan: &ActivityPlan,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    match aya::programs::tc::qdisc_detach_program(
        &plan.dev,
        TcAttachType::Egress,
        vmnet_plan::ns::activity::PROGRAM,
    ) {
        Ok(()) => Ok(true),
        Err(aya::programs::tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(false)
        }
        Err(e) => Err(Box::new(e)),
    }
}
