//! The host side of the driver: which namespace is "the host", running synchronous work there,
//! and the host-wide state ([`vmnet_plan::ns::HostPlan`]).

use vmnet_plan::ns::HostPlan;

use super::nftcheck::{self, ListingMemo};
use super::{NsError, inns};
use crate::netns;

/// The namespace the driver treats as the host: the calling process's own, or a named one (a
/// sandbox).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum HostNs {
    /// The process's network namespace.
    Current,
    /// A named namespace under /run/netns.
    Named(String),
}

impl HostNs {
    /// A label for errors.
    pub(super) fn label(&self) -> &str {
        match self {
            Self::Current => "host",
            Self::Named(n) => n,
        }
    }

    /// Runs `f` on a thread inside the host namespace (or on the calling thread for the process's
    /// own namespace).
    pub(super) fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NsError> {
        match self {
            Self::Current => Ok(f()),
            Self::Named(n) => Ok(netns::run_in(n, f)?),
        }
    }

    /// A strict rtnetlink handle in the host namespace (kernel-filtered dumps).
    pub(super) fn netlink(&self) -> Result<rtnetlink::Handle, NsError> {
        match self {
            Self::Current => {
                let (conn, h, _) =
                    rtnetlink::new_connection_with_strict_check().map_err(|source| {
                        NsError::Netns(netns::NetnsError::Io {
                            name: "host".into(),
                            op: "open rtnetlink socket",
                            source,
                        })
                    })?;
                tokio::spawn(conn);
                Ok(h)
            }
            Self::Named(n) => Ok(netns::netlink_in_strict(n)?),
        }
    }
}

/// The memo key of the host table.
fn host_key(plan: &HostPlan) -> String {
    nftcheck::key("host", "ip", &plan.nft_table)
}

/// Applies the host-wide plan: sysctls, then the masquerade table (one nft transaction), read
/// back once for the listing memo.
pub(super) fn apply_host(
    host: &HostNs,
    plan: &HostPlan,
    memo: &ListingMemo,
) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        inns::write_sysctls(&label, &plan.sysctls)?;
        inns::run_nft(&label, &plan.nft)?;
        let listing = nftcheck::or_empty(inns::list_table(&label, "ip", &plan.nft_table)?);
        memo.after_apply(
            &label,
            &host_key(plan),
            &plan.nft_fingerprint,
            &plan.nft,
            &listing,
        )
    })?
}

/// What of the host-wide state is not as planned (`None` when all is): sysctls, and the
/// masquerade table compared with the plan by content (chains, hooks, priorities, policies,
/// rules), so a deleted rule or chain or a flipped policy counts, not only a missing table.
pub(super) fn host_drift(
    host: &HostNs,
    plan: &HostPlan,
    memo: &ListingMemo,
) -> Result<Option<String>, NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        let mut bad = Vec::new();
        let sysctls = inns::sysctls_differ(&plan.sysctls);
        if !sysctls.is_empty() {
            bad.push(format!("sysctls {}", sysctls.join(", ")));
        }
        let listing = nftcheck::or_empty(inns::list_table(&label, "ip", &plan.nft_table)?);
        bad.extend(memo.drift(
            &label,
            &host_key(plan),
            &plan.nft_fingerprint,
            &plan.nft,
            &listing,
        )?);
        Ok((!bad.is_empty()).then(|| format!("{label}: {}", bad.join("; "))))
    })?
}

/// Removes the host masquerade table (sysctls are left as they are: other software may rely on
/// forwarding).
pub(super) fn remove_host(host: &HostNs, table: &str) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| inns::nft_delete_table(&label, "ip", table))?
}
