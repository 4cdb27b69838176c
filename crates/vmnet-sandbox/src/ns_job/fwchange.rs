//! The firewall change check of `vmnet-lab up --sandbox`: the first filtered VM (see
//! [`super::firewall::filtered`]) with a public IPv4 gets, by a `PUT` of its config, one more
//! inbound rule that admits the fake internet's client at the port its rules block; real
//! connections then show the port open, and closed again after a `PUT` of the original config.
//! A change of the firewall alone is what the agent applies as one nf_tables rule batch.
//!
//! | check | expected |
//! |---|---|
//! | `firewall change by PUT: tcp 8 from internet to <ipv4>` | `from <client>` |
//! | `firewall changed back by PUT: tcp 8 from internet to <ipv4>` | `no reach` |

use std::net::{IpAddr, SocketAddr};

use vmnet_agent::client::Client;
use vmnet_agent::status::VmView;
use vmnet_model::vm::VmConfig;
use vmnet_model::vm::firewall::{FirewallRule, PortRange, Protocol};

use super::checks::{CheckResult, NO_REACH};
use super::firewall::{BLOCKED_PORT, filtered, tcp};
use crate::echo::EchoService;
use crate::guest::GUEST_V4;
use crate::sandbox::INET_UPLINK_V4;

/// `vm`'s config with an inbound rule admitting the fake internet's client at [`BLOCKED_PORT`].
fn opened(vm: &VmConfig) -> VmConfig {
    let mut v = vm.clone();
    if let Some(fw) = v.firewall.as_mut() {
        fw.inbound.push(FirewallRule {
            protocol: Protocol::Tcp,
            ports: Some(PortRange {
                first: BLOCKED_PORT,
                last: BLOCKED_PORT,
            }),
            prefixes: vec![IpAddr::V4(INET_UPLINK_V4).into()],
        });
    }
    v
}

/// Opens and closes [`BLOCKED_PORT`] of the first filtered VM with a public IPv4 by two `PUT`s,
/// with a real connection from the fake internet `inet` after each; `guests` maps VM ids to
/// their guests' namespaces. No checks when no VM qualifies.
pub async fn run(
    client: &Client,
    inet: &str,
    vms: &[VmConfig],
    guests: &[(String, String)],
) -> Vec<CheckResult> {
    let Some((vm, addr, g)) = filtered(vms).into_iter().find_map(|v| {
        let g = guests.iter().find(|(id, _)| *id == v.id)?.1.clone();
        Some((v, v.public_ipv4?, g))
    }) else {
        return Vec::new();
    };
    let path = format!("/v1/vms/{}", vm.id);
    let to = SocketAddr::new(IpAddr::V4(addr), BLOCKED_PORT);
    let listen = [SocketAddr::new(IpAddr::V4(GUEST_V4), BLOCKED_PORT)];
    let mut out = Vec::new();
    for (config, name, expected) in [
        (
            opened(vm),
            "firewall change by PUT",
            format!("from {INET_UPLINK_V4}"),
        ),
        (
            vm.clone(),
            "firewall changed back by PUT",
            NO_REACH.to_owned(),
        ),
    ] {
        let check = format!("{name}: tcp {BLOCKED_PORT} from internet to {addr}");
        let seen = match client.put::<VmView>(&path, &config).await {
            Err(e) => format!("PUT failed: {e}"),
            Ok(_) => {
                let (inet, g) = (inet.to_owned(), g.clone());
                tokio::task::spawn_blocking(move || match EchoService::start(&g, &listen) {
                    Ok(_svc) => tcp(&inet, to),
                    Err(e) => format!("guest echo: {e}"),
                })
                .await
                .unwrap_or_else(|e| e.to_string())
            }
        };
        out.push(CheckResult {
            vm: vm.id.clone(),
            ok: seen == expected,
            check,
            expected,
            seen,
        });
    }
    out
}
