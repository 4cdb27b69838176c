//! Which BPF program a tc filter of ours runs, read back over rtnetlink (an ingress filter dump
//! of one device): the mesh's filter on a host veth end and the guest guard's on a VM's tap are
//! observed this way, and attached again only when missing or running another program.

use futures::TryStreamExt;
use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
use rtnetlink::Handle;

/// The id of the BPF program in the ingress filter at `priority` and `handle` on link `index`
/// (in the namespace of `h`); `None` when there is no such filter (or no clsact qdisc at all).
///
/// # Errors
/// The netlink error when the dump fails for another reason than a missing qdisc or device.
pub(crate) async fn ingress_program(
    h: &Handle,
    index: u32,
    priority: u16,
    handle: u32,
) -> Result<Option<u32>, rtnetlink::Error> {
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
        Err(e) => return Err(e),
    };
    Ok(msgs
        .iter()
        .filter(|m| {
            u32::from(m.header.handle) == handle && (m.header.info >> 16) == u32::from(priority)
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
