//! The host side of the driver: which namespace is "the host", running synchronous work there,
//! and the host-wide state ([`vmnet_plan::ns::HostPlan`]).

use vmnet_plan::ns::{FINGERPRINT_PREFIX, HostPlan};

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

/// Applies the host-wide plan: sysctls, then the masquerade table (one nft transaction).
pub(super) fn apply_host(host: &HostNs, plan: &HostPlan) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        inns::write_sysctls(&label, &plan.sysctls)?;
        inns::run_nft(&label, &plan.nft)
    })?
}

/// What of the host-wide state is not as planned (`None` when all is): sysctls, and the
/// masquerade table's content, compared by the fingerprint on its rule (so a flushed table or a
/// replaced rule counts, not only a missing table).
pub(super) fn host_drift(host: &HostNs, plan: &HostPlan) -> Result<Option<String>, NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        let mut bad = Vec::new();
        let sysctls = inns::sysctls_differ(&plan.sysctls);
        if !sysctls.is_empty() {
            bad.push(format!("sysctls {}", sysctls.join(", ")));
        }
        match inns::nft_table_comment(&label, "ip", &plan.nft_table, FINGERPRINT_PREFIX)? {
            None => bad.push(format!("nft table ip {} missing", plan.nft_table)),
            Some(fp) if fp != plan.nft_fingerprint => {
                bad.push(format!("nft table ip {} changed", plan.nft_table));
            }
            Some(_) => {}
        }
        Ok((!bad.is_empty()).then(|| format!("{label}: {}", bad.join("; "))))
    })?
}

/// Removes the host masquerade table (sysctls are left as they are: other software may rely on
/// forwarding).
pub(super) fn remove_host(host: &HostNs, table: &str) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| inns::nft_delete_table(&label, "ip", table))?
}
