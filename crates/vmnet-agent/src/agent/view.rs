//! The API view of a stored VM: its config with the status derived from its plan (names,
//! addresses, limits) and its stored outcome; and the agent's status (`GET /v1/status`).

use vmnet_ipam::vm_store::VmRow;
use vmnet_model::Error;
use vmnet_model::vm::VmConfig;
use vmnet_plan::ns::VmPlan;

use super::{Agent, decode, store_tx};
use crate::status::{AgentStatus, LimitStatus, VmCounts, VmState, VmStatus, VmView};
use vmnet_ipam::vm_store;

impl Agent {
    /// The API view of a stored row. A config that no longer plans under the current settings
    /// is shown `failed` with the reason in `last_error`.
    ///
    /// # Errors
    /// `INTERNAL` when the stored config no longer parses.
    pub fn view(&self, row: &VmRow) -> Result<VmView, Error> {
        let config = decode(row, &row.config, "desired")?;
        // A stored VM may no longer plan (the agent restarted with a smaller transit range):
        // show it with its derived names and the reason instead of failing the whole listing.
        let (p, plan_error, limits, filters) = match self.plan(&config) {
            Ok(plan) => (
                plan.status(),
                None,
                limit_rows(&plan),
                plan.firewall.is_some(),
            ),
            Err(e) => (
                self.unplanned_status(&config),
                Some(e.message),
                Vec::new(),
                false,
            ),
        };
        self.view_of(row, config, p, plan_error, limits, filters)
    }

    /// [`Agent::view`] of a row whose desired config `config` was just planned as `plan`.
    pub(crate) fn view_planned(
        &self,
        row: &VmRow,
        config: VmConfig,
        plan: &VmPlan,
    ) -> Result<VmView, Error> {
        self.view_of(
            row,
            config,
            plan.status(),
            None,
            limit_rows(plan),
            plan.firewall.is_some(),
        )
    }

    fn view_of(
        &self,
        row: &VmRow,
        config: VmConfig,
        p: vmnet_plan::ns::VmStatus,
        plan_error: Option<String>,
        limits: Vec<LimitStatus>,
        filters: bool,
    ) -> Result<VmView, Error> {
        let applied = if row.applied.as_deref() == Some(row.config.as_str()) {
            Some(config.clone())
        } else {
            row.applied
                .as_deref()
                .map(|a| decode(row, a, "applied"))
                .transpose()?
        };
        let state = if row.last_error.is_some() || plan_error.is_some() {
            VmState::Failed
        } else if applied.as_ref() == Some(&config) {
            VmState::Applied
        } else {
            VmState::Pending
        };
        let applied_now = state == VmState::Applied;
        let limits = limits
            .into_iter()
            .map(|l| LimitStatus {
                applied: l.applied && applied_now,
                ..l
            })
            .collect();
        let status = VmStatus {
            firewall_filtering: filters && applied_now,
            firewall_repairs: self.firewall_repairs_of(&row.id),
            guard_drops: None,
            limits,
            state,
            netns: p.netns,
            veth_host: p.host_veth,
            veth_ns: p.peer_veth,
            transit: p.transit.map(|t| t.to_string()),
            mtu: p.mtu,
            tap: p.tap,
            tap_owner: self.settings.tap_owner_uid,
            guest_ipv4: p.guest_ipv4.addr().to_string(),
            gateway_ipv4: p.gateway_ipv4.to_string(),
            guest_mac: p.guest_mac,
            mesh_ipv6: p.mesh_ipv6.map(|m| m.to_string()),
            applied_public_ipv4: applied
                .as_ref()
                .and_then(|a| a.public_ipv4)
                .map(|a| a.to_string()),
            applied_public_ipv6: applied.as_ref().and_then(|a| {
                a.public_ipv6_mapped()
                    .map(|m| m.to_string())
                    .or_else(|| a.public_ipv6_block().map(|b| b.to_string()))
            }),
            public_neighbors: self.settings.public_neighbors,
            applied_routes: applied.map(|a| a.network.routes).unwrap_or_default(),
            last_error: row.last_error.clone().or(plan_error),
            updated_at_unix_ms: row.updated_at,
        };
        Ok(VmView { config, status })
    }

    /// The status fields that derive from names alone, for a config that does not plan.
    fn unplanned_status(&self, cfg: &VmConfig) -> vmnet_plan::ns::VmStatus {
        use vmnet_plan::ns::{
            GATEWAY_IPV4, GUEST_IPV4, GUEST_MAC, HOST_LINK_LOCAL, NameKind, TAP_PREFIX_LEN, name,
        };
        let p = &self.settings.name_prefix;
        let with_veth = cfg.mesh_ipv6.is_some();
        vmnet_plan::ns::VmStatus {
            netns: name(p, NameKind::Netns, cfg.user_id),
            host_veth: with_veth.then(|| name(p, NameKind::HostVeth, cfg.user_id)),
            peer_veth: with_veth.then(|| name(p, NameKind::PeerVeth, cfg.user_id)),
            transit: None,
            tap: name(p, NameKind::Tap, cfg.user_id),
            guest_ipv4: ipnet::Ipv4Net::new(GUEST_IPV4, TAP_PREFIX_LEN).unwrap_or_default(),
            gateway_ipv4: GATEWAY_IPV4,
            guest_mac: GUEST_MAC
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
            gateway_ipv6: HOST_LINK_LOCAL,
            mesh_ipv6: cfg.mesh_ipv6,
            mtu: self.settings.mtu,
            nat: false,
            routes: cfg.network.routes.clone(),
            public_ipv4: None,
            public_ipv6: None,
        }
    }
}

/// The four limit rows of a plan (download then upload, private then public), without counters;
/// `applied` tells whether the plan shapes that class.
fn limit_rows(plan: &vmnet_plan::ns::VmPlan) -> Vec<LimitStatus> {
    use vmnet_plan::ns::limits::{Direction, TrafficClass};
    let l = &plan.limits;
    let mut out = Vec::with_capacity(4);
    for direction in [Direction::Download, Direction::Upload] {
        for (class, limit_mibps) in [
            (TrafficClass::Private, l.private_mibps),
            (TrafficClass::Public, l.public_mibps),
        ] {
            let applied = l
                .trees
                .iter()
                .filter(|t| t.direction == direction)
                .flat_map(|t| &t.classes)
                .any(|c| c.class == class && c.applied);
            out.push(LimitStatus {
                class,
                direction,
                limit_mibps,
                applied,
                bytes: None,
                packets: None,
                drops: None,
            });
        }
    }
    out
}

/// The answer for an id that names no stored VM: `INVALID_INPUT` when it could never name one
/// (the rule a PUT applies), else `NOT_FOUND`.
pub(crate) fn vm_not_found(id: &str) -> Error {
    match vmnet_model::vm::validate_vm_id(id) {
        Err(e) => e.into(),
        Ok(()) => Error::not_found(format!("vm {id} not found")),
    }
}

impl Agent {
    /// `GET /v1/status`.
    ///
    /// # Errors
    /// `UNAVAILABLE` on a store failure.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        let mut vms = VmCounts {
            desired: rows.len() as u64,
            ..VmCounts::default()
        };
        for r in &rows {
            if r.last_error.is_some() {
                vms.failed += 1;
            } else if r.applied.as_deref() == Some(r.config.as_str()) {
                vms.applied += 1;
            }
        }
        let reconcile = self.record.lock().map(|r| r.clone()).unwrap_or_default();
        let pool = match self.pool.get() {
            Some(p) => Some(p.status().await),
            None => None,
        };
        let provider_pools = self.providers.get().map(|p| p.status());
        Ok(AgentStatus {
            guest_guard: self.guest_guard_status(),
            provider_pools,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            name_prefix: self.settings.name_prefix.clone(),
            reconcile_interval_secs: self.interval.as_secs(),
            vms,
            reconcile,
            pool,
            firewall: self.firewall_status(),
            worker: self.worker.get().map(|w| w.status()),
            kernel: self.kernel.status(),
        })
    }
}
