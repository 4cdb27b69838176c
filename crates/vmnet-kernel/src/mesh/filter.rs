//! Which program our mesh filter on a device runs, read back over rtnetlink (an ingress filter
//! dump of that one device): the agent observes a VM's filter as part of its state (missing,
//! or running another program) and re-attaches only then, instead of replacing every filter on
//! every pass.

use futures::TryStreamExt;
use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
use rtnetlink::Handle;

use super::{FILTER_HANDLE, FILTER_PRIORITY, MeshError};

/// The id of the BPF program in our filter (priority [`FILTER_PRIORITY`], handle
/// [`FILTER_HANDLE`]) on the ingress of link `index`; `None` when there is no such filter (or
/// no clsact qdisc at all).
///
/// # Errors
/// [`MeshError::Netlink`] when the dump fails for another reason than a missing qdisc.
pub async fn filter_program(h: &Handle, index: u32) -> Result<Option<u32>, MeshError> {
    let ifindex = i32::try_from(index).unwrap_or(i32::MAX);
    let res: Result<Vec<_>, _> = h
        .traffic_filter(ifindex)
        .get()
        .ingress()
        .execute()
        .try_collect()
        .await;
    let msgs = match res {
        Ok(m) => m,
        // No clsact qdisc (or no device): no filter.
        Err(rtnetlink::Error::NetlinkError(e))
            if matches!(
                e.raw_code().abs(),
                libc::EINVAL | libc::ENOENT | libc::ENODEV
            ) =>
        {
            return Ok(None);
        }
        Err(source) => {
            return Err(MeshError::Netlink {
                what: format!("dump the ingress filters of link #{index}"),
                source,
            });
        }
    };
    let handle = u32::from(FILTER_HANDLE);
    Ok(msgs
        .iter()
        .filter(|m| {
            u32::from(m.header.handle) == handle
                && (m.header.info >> 16) == u32::from(FILTER_PRIORITY)
        })
        .find_map(|m| {
            m.attributes.iter().find_map(|a| match a {
                TcAttribute::Options(opts) => opts.iter().find_map(|o| match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                    _ => None,
                }),
                _ => None,
            })
        }))
}
