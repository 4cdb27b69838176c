//! Which program our mesh filter on a device runs, read back over rtnetlink (an ingress filter
//! dump of that one device): the agent observes a VM's filter as part of its state (missing,
//! or running another program) and re-attaches only then, instead of replacing every filter on
//! every pass.

use rtnetlink::Handle;

use super::{FILTER_HANDLE, FILTER_PRIORITY, MeshError};

/// The id of the BPF program in our filter (priority [`FILTER_PRIORITY`], handle
/// [`FILTER_HANDLE`]) on the ingress of link `index`; `None` when there is no such filter (or
/// no clsact qdisc at all).
///
/// # Errors
/// [`MeshError::Netlink`] when the dump fails for another reason than a missing qdisc.
pub async fn filter_program(h: &Handle, index: u32) -> Result<Option<u32>, MeshError> {
    crate::tcfilter::ingress_program(h, index, FILTER_PRIORITY, u32::from(FILTER_HANDLE))
        .await
        .map_err(|source| MeshError::Netlink {
            what: format!("dump the ingress filters of link #{index}"),
            source,
        })
}
