//! The per-tap activity filter of earlier versions (a `cls_bpf` filter on the tap's clsact
//! egress, see [`vmnet_plan::ns::activity`]): read back over rtnetlink and deleted, so an
//! upgraded host loses them.

use std::fmt;

use futures::StreamExt;
use rtnetlink::Handle;
use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{
    TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle as NlHandle, TcMessage, TcOption,
};
use vmnet_plan::ns::activity::{LEGACY_FILTER_HANDLE, LEGACY_FILTER_PRIORITY, LEGACY_PROGRAM};

use aya::programs::TcAttachType;

use super::ActivityError;

/// The clsact egress parent (`TC_H_CLSACT | TC_H_MIN_EGRESS`).
const CLSACT_EGRESS: u32 = 0xffff_fff3;

/// The filter found at the earlier versions' priority and handle.
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
    /// Whether this is a direct-action bpf filter running a program named as the earlier
    /// versions' ([`LEGACY_PROGRAM`]), whatever its id.
    #[must_use]
    pub fn is_activity_program(&self) -> bool {
        self.kind == "bpf"
            && self.direct_action
            && self.prog_name.as_deref() == Some(LEGACY_PROGRAM)
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

/// The filter at the earlier versions' priority and handle on the egress of `dev` (in the
/// namespace of `ns`), `None` when there is none (or no clsact qdisc).
pub(super) async fn observe(
    netns: &str,
    ns: &Handle,
    dev: &str,
) -> Result<Option<ObservedFilter>, ActivityError> {
    let no_dev = || ActivityError::NoDevice {
        netns: netns.to_owned(),
        dev: dev.to_owned(),
    };
    let obs = |source| ActivityError::Observe {
        netns: netns.to_owned(),
        dev: dev.to_owned(),
        source,
    };
    let link = crate::netlink::link_by_name(ns, dev)
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
                if prio == LEGACY_FILTER_PRIORITY
                    && u32::from(m.header.handle) == LEGACY_FILTER_HANDLE
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

/// Deletes the earlier versions' filter from the egress of `dev` (current thread's namespace);
/// `Ok(false)` when there was none.
pub(super) fn detach(dev: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    match aya::programs::tc::qdisc_detach_program(dev, TcAttachType::Egress, LEGACY_PROGRAM) {
        Ok(()) => Ok(true),
        Err(aya::programs::tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(false)
        }
        Err(e) => Err(Box::new(e)),
    }
}

/// The per-tap activity filter of an earlier version (a direct-action `bpf` filter running a
/// program named [`vmnet_plan::ns::activity::LEGACY_PROGRAM`], at that version's priority and
/// handle) on the egress of `tap` in `netns` (whose rtnetlink handle is `ns`); `None` when there
/// is none or no such device. Needs no loaded program.
///
/// # Errors
/// [`ActivityError::Observe`].
pub async fn leftover_filter(
    netns: &str,
    ns: &Handle,
    tap: &str,
) -> Result<Option<ObservedFilter>, ActivityError> {
    match observe(netns, ns, tap).await {
        Ok(Some(f)) if f.is_activity_program() => Ok(Some(f)),
        Ok(_) | Err(ActivityError::NoDevice { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Deletes the earlier version's activity filter from the egress of `tap` in `netns`.
/// `Ok(false)` when there was none.
///
/// # Errors
/// [`ActivityError::Detach`] when listing or deleting the filter fails.
pub fn detach_filter(netns: &str, tap: &str) -> Result<bool, ActivityError> {
    crate::netns::run_in(netns, || detach(tap))?.map_err(|source| ActivityError::Detach {
        netns: netns.to_owned(),
        dev: tap.to_owned(),
        source,
    })
}
