//! Proxmox VE (API reference: the PVE API viewer, <https://pve.proxmox.com/pve-docs/api-viewer/>,
//! API2 JSON of Proxmox VE 8; every answer is `{"data": …}`).
//!
//! One poll, with `Authorization: PVEAPIToken=USER@REALM!TOKENID=SECRET`:
//! 1. `GET {api_url}/cluster/resources?type=vm`: every VM and container of the cluster in one
//!    answer (`type`, `node`, `vmid`, `status`). The node asked below is the one this list names
//!    (a migrated VM is followed); a machine whose vmid is not a QEMU VM in the list is
//!    `missing` and has no addresses.
//! 2. For each machine whose VM is `running`, with at most
//!    [`HttpSettings::concurrency`](super::http::HttpSettings::concurrency) in flight:
//!    `GET {api_url}/nodes/{node}/qemu/{vmid}/config`, and only when its `agent` property is
//!    enabled (`1`, or `enabled=1,…`), `GET …/qemu/{vmid}/agent/network-get-interfaces`.
//!
//! A stopped VM, and a running VM without the guest agent enabled, has no addresses. A running
//! VM's addresses are its guest agent's (`result[].ip-addresses[]`: `ip-address` with `prefix`),
//! in interface order, without loopback and link-local ones. A failing config or agent call
//! (a `500` while the agent inside the guest is not up yet) fails that machine only: it keeps
//! its last good addresses, marked stale.

use futures::StreamExt;
use ipnet::IpNet;
use serde::Deserialize;
use vmnet_ipam::MachinePoll;
use vmnet_model::pool::Machine;

use super::http::Api;
use super::{PollError, PollReport, push_address};

/// `{"data": T}`, the envelope of every Proxmox VE answer.
#[derive(Debug, Clone, Deserialize)]
pub struct Data<T> {
    /// The payload.
    pub data: T,
}

/// One entry of `GET /cluster/resources?type=vm`.
#[derive(Debug, Clone, Deserialize)]
pub struct Resource {
    /// `qemu` or `lxc`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The node it is on now.
    pub node: String,
    /// The vmid.
    pub vmid: u32,
    /// `running`, `stopped`, …
    #[serde(default)]
    pub status: Option<String>,
}

/// `GET /nodes/{node}/qemu/{vmid}/config` (only `agent` is read).
#[derive(Debug, Clone, Deserialize)]
pub struct VmConfig {
    /// The `agent` property: `1`, `0`, or `[enabled=]<1|0>[,fstrim_cloned_disks=…][,type=…]`;
    /// absent when not set (the agent is off).
    #[serde(default)]
    pub agent: Option<serde_json::Value>,
}

impl VmConfig {
    /// Whether the QEMU guest agent is enabled.
    #[must_use]
    pub fn agent_enabled(&self) -> bool {
        match &self.agent {
            Some(serde_json::Value::Number(n)) => n.as_u64() == Some(1),
            Some(serde_json::Value::Bool(b)) => *b,
            Some(serde_json::Value::String(s)) => s
                .split(',')
                .map(str::trim)
                .any(|part| part == "1" || part == "enabled=1"),
            _ => false,
        }
    }
}

/// `GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces`: `{"result": [...]}`.
#[derive(Debug, Clone, Deserialize)]
pub struct AgentInterfaces {
    /// The guest's interfaces.
    pub result: Vec<Interface>,
}

/// One guest interface.
#[derive(Debug, Clone, Deserialize)]
pub struct Interface {
    /// Its name in the guest, e.g. `eth0`.
    #[serde(default)]
    pub name: String,
    /// Its addresses.
    #[serde(default, rename = "ip-addresses")]
    pub ip_addresses: Vec<AgentAddress>,
}

/// One address of a guest interface.
#[derive(Debug, Clone, Deserialize)]
pub struct AgentAddress {
    /// The address, e.g. `10.0.0.5` or `fe80::1`.
    #[serde(rename = "ip-address")]
    pub ip_address: String,
    /// Its prefix length.
    pub prefix: u8,
}

impl AgentInterfaces {
    /// The guest's addresses in CIDR form (host bits kept), interface by interface; loopback,
    /// link-local and unparsable entries dropped.
    #[must_use]
    pub fn addresses(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        for i in &self.result {
            for a in &i.ip_addresses {
                let Ok(ip) = a.ip_address.parse() else {
                    tracing::debug!(interface = %i.name, address = %a.ip_address, "guest agent address does not parse; skipped");
                    continue;
                };
                if let Ok(net) = IpNet::new(ip, a.prefix) {
                    push_address(&mut out, net);
                }
            }
        }
        out
    }
}

/// One machine's addresses now: none unless running with the agent enabled.
async fn machine_addresses(
    api: &Api,
    base: &str,
    node: &str,
    vmid: u32,
) -> Result<Vec<IpNet>, PollError> {
    let vm = format!("{base}/nodes/{node}/qemu/{vmid}");
    let config: Data<VmConfig> = api.get(&format!("{vm}/config")).await?;
    if !config.data.agent_enabled() {
        return Ok(Vec::new());
    }
    let ifs: Data<AgentInterfaces> = api
        .get(&format!("{vm}/agent/network-get-interfaces"))
        .await?;
    Ok(ifs.data.addresses())
}

/// Polls the pool's machines (see the module docs).
///
/// # Errors
/// The cluster listing's [`PollError`]; per-machine failures are in the report's `errors`.
pub async fn poll(
    api: &Api,
    base: &str,
    machines: &[(String, Machine)],
) -> Result<PollReport, PollError> {
    let list: Data<Vec<Resource>> = api
        .get(&format!("{base}/cluster/resources?type=vm"))
        .await?;
    let mut report = PollReport::default();
    let mut running: Vec<(usize, String, u32)> = Vec::new();
    for (i, (instance_id, m)) in machines.iter().enumerate() {
        let found = list
            .data
            .iter()
            .find(|r| r.kind == "qemu" && Some(r.vmid) == m.vmid);
        let addresses = match found {
            None => {
                report.missing.push(instance_id.clone());
                Some(Vec::new())
            }
            Some(r) if r.status.as_deref() == Some("running") => {
                running.push((i, r.node.clone(), r.vmid));
                None
            }
            Some(_) => Some(Vec::new()),
        };
        report.results.push(MachinePoll {
            instance_id: instance_id.clone(),
            addresses,
        });
    }
    let fetched: Vec<(usize, Result<Vec<IpNet>, PollError>)> = futures::stream::iter(running)
        .map(|(i, node, vmid)| async move { (i, machine_addresses(api, base, &node, vmid).await) })
        .buffer_unordered(api.settings().concurrency.max(1))
        .collect()
        .await;
    for (i, r) in fetched {
        match r {
            Ok(a) => report.results[i].addresses = Some(a),
            Err(e) => report
                .errors
                .push((report.results[i].instance_id.clone(), e)),
        }
    }
    report.errors.sort_by(|a, b| a.0.cmp(&b.0));
    report.requests = api.requests();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_property_forms() {
        let c = |v: serde_json::Value| VmConfig { agent: Some(v) }.agent_enabled();
        assert!(c(serde_json::json!("1")));
        assert!(c(serde_json::json!(1)));
        assert!(c(serde_json::json!("enabled=1,fstrim_cloned_disks=1")));
        assert!(c(serde_json::json!("1,type=virtio")));
        assert!(!c(serde_json::json!("0")));
        assert!(!c(serde_json::json!("enabled=0,fstrim_cloned_disks=1")));
        assert!(!c(serde_json::json!("fstrim_cloned_disks=1")));
        assert!(!VmConfig { agent: None }.agent_enabled());
    }

    #[test]
    fn guest_agent_addresses_without_loopback_and_link_local() {
        let d: Data<AgentInterfaces> = serde_json::from_str(
            r#"{"data": {"result": [
              {"name": "lo", "hardware-address": "00:00:00:00:00:00",
               "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                                {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128}],
               "statistics": {"rx-bytes": 1}},
              {"name": "eth0", "hardware-address": "bc:24:11:00:00:01",
               "ip-addresses": [{"ip-address": "10.0.0.5", "ip-address-type": "ipv4", "prefix": 24},
                                {"ip-address": "2001:db8::5", "ip-address-type": "ipv6", "prefix": 64},
                                {"ip-address": "fe80::be24:11ff:fe00:1", "ip-address-type": "ipv6", "prefix": 64}]},
              {"name": "eth1", "hardware-address": "bc:24:11:00:00:02"}
            ]}}"#,
        )
        .unwrap();
        let got: Vec<String> = d.data.addresses().iter().map(ToString::to_string).collect();
        assert_eq!(got, ["10.0.0.5/24", "2001:db8::5/64"]);
    }
}
