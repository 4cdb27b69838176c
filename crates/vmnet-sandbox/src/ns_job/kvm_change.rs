//! Changes to a running real guest, each watched from inside it ([`crate::kvm::watch`]: `ip
//! monitor` and an IPv4 ping of the gateway every 10 ms): the VM's network changes by `PUT` and
//! `vmnet-guest` applies the change in the guest while qemu holds the tap. Only what changed
//! may change in the guest's kernel, and no ping may go unanswered.
//!
//! | check | expected |
//! |---|---|
//! | `mesh address change by PUT, in the running guest` | `<new>/128` on `eth0` |
//! | `mesh -> <vm> at its new address, from <peer>` | `from <peer mesh>` (from the peer's guest) |
//! | `mesh -> <vm> at its old address, from <peer>` | `no reach` |
//! | `mesh address changed back by PUT` | `<original>/128` |
//! | `host route added by PUT, in the running guest` / `… removed …` | `present` / `absent` |
//! | `ipv4 ping every 10 ms across <change>` | `0 lost` |
//! | `ip monitor across <change>` | `only <the changed objects>` |
//! | `vmnet-guest restarted with unchanged metadata: drop-in` | `not rewritten` |
//! | `ip monitor across a restart of vmnet-guest` | `nothing` |
//!
//! The change window of each watch ends [`SETTLE`] after the change showed in the guest, so a
//! later teardown of the interface (a reload of networkd) would be seen too.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use vmnet_agent::api::types::VmView;
use vmnet_agent::client::{Client, segment};
use vmnet_model::vm::{Route, Via, VmConfig};

use super::checks::{CheckResult, NO_REACH};
use crate::kvm::ns::{self as kns, NsGuest};
use crate::kvm::watch::{Watch, Watched};
use crate::sandbox::ECHO_PORT;

/// How long `vmnet-guest` gets to apply a change.
const CHANGE_WAIT: Duration = Duration::from_secs(30);
/// How long a watch goes on after the change showed in the guest.
pub const SETTLE: Duration = Duration::from_secs(3);
/// The host route the route change adds (a documentation prefix nothing else uses).
pub const EXTRA_ROUTE: &str = "2001:db8:ffff::/48";
/// The guest's drop-in (the image's `.network` file is `10-eth0.network`).
const DROP_IN: &str = "/etc/systemd/network/10-eth0.network.d/50-vmnet-guest.conf";

/// The VM whose mesh address the change check moves (index into `vms`) and the peer that
/// probes it: the first VM with a mesh address, no firewall and no VM routing via it (one
/// without public addresses if there is one), and another VM with a mesh address and no
/// firewall of the same tenant.
#[must_use]
pub fn change_pair(vms: &[VmConfig]) -> Option<(usize, usize)> {
    let plain =
        |v: &VmConfig| v.mesh_ipv6.is_some() && !v.firewall.as_ref().is_some_and(|f| f.enabled);
    let gateway = |m: Option<Ipv6Addr>| {
        vms.iter()
            .flat_map(|w| &w.network.routes)
            .any(|r| Some(r.via) == m.map(Via::Mesh))
    };
    // A VM without public addresses first: its move touches nothing but the mesh.
    let public = |v: &VmConfig| v.public_ipv4.is_some() || v.public_ipv6.is_some();
    let m = (0..vms.len())
        .filter(|&i| plain(&vms[i]) && !gateway(vms[i].mesh_ipv6))
        .min_by_key(|&i| public(&vms[i]))?;
    let p = vms
        .iter()
        .enumerate()
        .position(|(j, w)| j != m && plain(w) && w.tenant == vms[m].tenant)?;
    Some((m, p))
}

/// A mesh address for `old` that no VM of `vms` holds: its last group with the top bit flipped.
#[must_use]
pub fn moved_mesh(old: Ipv6Addr, vms: &[VmConfig]) -> Option<Ipv6Addr> {
    let mut seg = old.segments();
    (0..16u16).find_map(|k| {
        seg[7] = old.segments()[7] ^ (0x8000 | k);
        let a = Ipv6Addr::from(seg);
        (!vms.iter().any(|v| v.mesh_ipv6 == Some(a))).then_some(a)
    })
}

/// The checks of one watch: no ping lost, no event but of `allowed` (`what` names the change).
fn watch_checks(
    vm: &str,
    what: &str,
    allowed: &[String],
    w: Result<Watched, String>,
) -> Vec<CheckResult> {
    let w = match w {
        Ok(w) => w,
        Err(e) => {
            return vec![CheckResult::new(
                vm,
                &format!("watch across {what}"),
                "watched".into(),
                e,
            )];
        }
    };
    let only = if allowed.is_empty() {
        "nothing".to_owned()
    } else {
        format!("only {}", allowed.join(", "))
    };
    let extra = w.unexpected(allowed);
    let seen = if extra.is_empty() {
        only.clone()
    } else {
        format!(
            "also {} other events: {}",
            extra.len(),
            extra
                .iter()
                .take(4)
                .cloned()
                .collect::<Vec<_>>()
                .join(" | ")
        )
    };
    vec![
        CheckResult {
            vm: vm.to_owned(),
            check: format!("ipv4 ping every 10 ms across {what}"),
            expected: "0 lost".into(),
            seen: format!("{} lost of {}", w.lost(), w.sent),
            ok: w.lost() == 0 && w.sent > 0,
        },
        CheckResult::new(vm, &format!("ip monitor across {what}"), only, seen),
    ]
}

/// Runs `change` (a `PUT`) with a watch in guest `g`, then `settled` in the guest (which waits
/// until the change shows there and says what it sees), then [`SETTLE`]; what `settled` saw and
/// what the watch saw.
async fn watched<F>(
    g: &mut NsGuest,
    change: F,
    settled: impl FnOnce(&mut NsGuest) -> String,
) -> (String, Result<Watched, String>)
where
    F: std::future::Future<Output = Result<VmView, vmnet_model::Error>>,
{
    let w = tokio::task::block_in_place(|| Watch::start(g));
    let seen = match change.await {
        Err(e) => format!("PUT failed: {e}"),
        Ok(_) => tokio::task::block_in_place(|| settled(g)),
    };
    tokio::time::sleep(SETTLE).await;
    let w = match w {
        Ok(w) => tokio::task::block_in_place(|| w.stop(g)),
        Err(e) => Err(e),
    };
    (seen, w)
}

/// The changes of the module docs on the VM [`change_pair`] picks.
pub(super) async fn run(
    client: &Client,
    vms: &[VmConfig],
    guests: &mut [NsGuest],
) -> Vec<CheckResult> {
    let Some((m, p)) = change_pair(vms) else {
        return Vec::new();
    };
    let (Some(old), Some(peer_mesh)) = (vms[m].mesh_ipv6, vms[p].mesh_ipv6) else {
        return Vec::new();
    };
    let Some(new) = moved_mesh(old, vms) else {
        return Vec::new();
    };
    let (Some(gi), Some(pi)) = (
        guests.iter().position(|g| g.id == vms[m].id),
        guests.iter().position(|g| g.id == vms[p].id),
    ) else {
        return Vec::new();
    };
    let id = vms[m].id.clone();
    let path = format!("/v1/vms/{}", segment(&id));
    let mut out = Vec::new();
    let add = |out: &mut Vec<CheckResult>, check: String, expected: String, seen: String| {
        out.push(CheckResult::new(&id, &check, expected, seen));
    };
    let addresses = [old.to_string(), new.to_string()];

    // The mesh address moves.
    let mut changed = vms[m].clone();
    changed.mesh_ipv6 = Some(new);
    let want = format!("{new}/128");
    let w = want.clone();
    let (seen, watch) = watched(
        &mut guests[gi],
        client.put::<VmView>(&path, &changed),
        |g| g.wait_addresses(&w, "-6", CHANGE_WAIT),
    )
    .await;
    let applied = seen == want;
    add(
        &mut out,
        "mesh address change by PUT, in the running guest".into(),
        want,
        seen,
    );
    out.extend(watch_checks(
        &id,
        "the mesh address change",
        &addresses,
        watch,
    ));
    if applied {
        let (to_new, to_old) = tokio::task::block_in_place(|| {
            let at = |a: Ipv6Addr| SocketAddr::new(IpAddr::V6(a), ECHO_PORT);
            let g = &mut guests[pi];
            let mut s = kns::probe(g, "tcp", at(new), None);
            if s == NO_REACH {
                std::thread::sleep(Duration::from_secs(1));
                s = kns::probe(g, "tcp", at(new), None);
            }
            (s, kns::probe(g, "tcp", at(old), None))
        });
        add(
            &mut out,
            format!("mesh -> {id} at its new address, from {}", vms[p].id),
            format!("from {peer_mesh}"),
            to_new,
        );
        add(
            &mut out,
            format!("mesh -> {id} at its old address, from {}", vms[p].id),
            NO_REACH.into(),
            to_old,
        );
    }
    // And back.
    let want = format!("{old}/128");
    let w = want.clone();
    let (seen, watch) = watched(&mut guests[gi], client.put::<VmView>(&path, &vms[m]), |g| {
        g.wait_addresses(&w, "-6", CHANGE_WAIT)
    })
    .await;
    add(
        &mut out,
        "mesh address changed back by PUT".into(),
        want,
        seen,
    );
    out.extend(watch_checks(
        &id,
        "the mesh address change back",
        &addresses,
        watch,
    ));

    // A host route comes and goes.
    let extra: ipnet::IpNet = EXTRA_ROUTE.parse().expect("a prefix");
    let mut routed = vms[m].clone();
    routed.network.routes.push(Route {
        destination: extra,
        via: Via::Host,
    });
    let allowed = [EXTRA_ROUTE.to_owned()];
    for (body, state, what) in [
        (&routed, "present", "added"),
        (&vms[m], "absent", "removed"),
    ] {
        let (seen, watch) = watched(&mut guests[gi], client.put::<VmView>(&path, body), |g| {
            g.wait_route(EXTRA_ROUTE, state == "present", CHANGE_WAIT)
        })
        .await;
        add(
            &mut out,
            format!("host route {EXTRA_ROUTE} {what} by PUT, in the running guest"),
            state.into(),
            seen,
        );
        out.extend(watch_checks(
            &id,
            &format!("the host route {what}"),
            &allowed,
            watch,
        ));
    }

    // vmnet-guest restarts: the metadata is what is on disk and in the kernel already.
    let g = &mut guests[gi];
    let stat = format!("stat -c %y {DROP_IN}");
    let before = tokio::task::block_in_place(|| g.sh(&stat, Duration::from_secs(10)));
    let w = tokio::task::block_in_place(|| Watch::start(g));
    let restarted = tokio::task::block_in_place(|| {
        g.sh(
            "systemctl restart vmnet-guest && sleep 2 && systemctl is-active vmnet-guest",
            Duration::from_secs(30),
        )
    });
    tokio::time::sleep(SETTLE).await;
    let w = match w {
        Ok(w) => tokio::task::block_in_place(|| w.stop(g)),
        Err(e) => Err(e),
    };
    let after = tokio::task::block_in_place(|| g.sh(&stat, Duration::from_secs(10)));
    let seen = if restarted != "active" {
        format!("restart failed: {restarted}")
    } else if before == after {
        "not rewritten".into()
    } else {
        format!("rewritten ({before} -> {after})")
    };
    add(
        &mut out,
        "vmnet-guest restarted with unchanged metadata: drop-in".into(),
        "not rewritten".into(),
        seen,
    );
    out.extend(watch_checks(&id, "a restart of vmnet-guest", &[], w));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vms() -> Vec<VmConfig> {
        let spec = include_str!("../../../../examples/host.json");
        vmnet_agent::hostspec::HostSpec::parse("host.json", spec)
            .expect("example spec")
            .vms
    }

    #[test]
    fn the_change_moves_a_plain_vm_that_is_no_gateway_and_a_peer_probes_it() {
        let vms = vms();
        let (m, p) = change_pair(&vms).expect("a pair");
        // vm-gateway carries vm-behind-gateway's route; vm-firewall filters: vm-isolated moves.
        assert_eq!(vms[m].id, "vm-isolated");
        assert_eq!(vms[p].id, "vm-gateway");
    }

    #[test]
    fn the_two_vm_example_moves_the_vm_without_public_addresses() {
        let spec = include_str!("../../../../examples/ns-kvm.json");
        let vms = vmnet_agent::hostspec::HostSpec::parse("ns-kvm.json", spec)
            .expect("example spec")
            .vms;
        let (m, p) = change_pair(&vms).expect("a pair");
        assert_eq!(
            (vms[m].id.as_str(), vms[p].id.as_str()),
            ("vm-isolated", "vm-gateway")
        );
    }

    #[test]
    fn the_moved_address_is_free() {
        let vms = vms();
        let old: Ipv6Addr = "fdaa:1::8".parse().unwrap();
        assert_eq!(moved_mesh(old, &vms), Some("fdaa:1::8008".parse().unwrap()));
        let mut taken = vms.clone();
        taken[0].mesh_ipv6 = Some("fdaa:1::8008".parse().unwrap());
        assert_eq!(
            moved_mesh(old, &taken),
            Some("fdaa:1::8009".parse().unwrap())
        );
    }
}
