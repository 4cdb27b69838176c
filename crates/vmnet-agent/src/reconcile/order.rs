//! The order of a pass: which VMs it converges first, and which of them together.

use vmnet_ipam::vm_store::VmRow;
use vmnet_model::vm::{Via, parse_vm_config};

/// The ids of `rows` in the order a pass converges them, in two groups: first the VMs without
/// a route via a gateway VM's mesh address, then those with one, each group in store order. A
/// config that does not parse counts as the first group's (its apply reports the error).
pub(super) fn pass_order(rows: Vec<VmRow>) -> [Vec<String>; 2] {
    let (behind, first): (Vec<VmRow>, Vec<VmRow>) = rows
        .into_iter()
        .partition(|r| routes_via_gateway(&r.config));
    [
        first.into_iter().map(|r| r.id).collect(),
        behind.into_iter().map(|r| r.id).collect(),
    ]
}

/// Whether a stored config routes anything via a gateway VM.
fn routes_via_gateway(config: &str) -> bool {
    parse_vm_config(config.as_bytes()).is_ok_and(|c| {
        c.network
            .routes
            .iter()
            .any(|r| matches!(r.via, Via::Mesh(_)))
    })
}

/// Splits the rows one step of a pass read into those it converges together (their desired
/// config applied without error, so only it is planned: each has its own user id, which the
/// store keeps unique) and those it converges one after another (a VM whose apply may fall
/// back to its last good config, whose user id may be another's now).
pub(super) fn together(rows: Vec<VmRow>) -> (Vec<VmRow>, Vec<VmRow>) {
    rows.into_iter()
        .partition(|r| r.last_error.is_none() && r.applied.as_deref() == Some(r.config.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, uid: u32, routes: &str) -> VmRow {
        VmRow {
            id: id.to_owned(),
            user_id: uid,
            mesh: None,
            config: format!(
                r#"{{"id":"{id}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid:x}","network":{{"routes":{routes}}}}}"#
            ),
            applied: None,
            last_error: None,
            updated_at: 0,
        }
    }

    #[test]
    fn vms_behind_a_gateway_come_after_the_others() {
        let behind = r#"[{"destination":"2000::/3","via":"fdaa:1::7"}]"#;
        let host = r#"[{"destination":"0.0.0.0/0","via":"host"}]"#;
        let rows = vec![
            row("a-behind", 1, behind),
            row("b", 2, host),
            row("c-behind", 3, behind),
            row("gateway", 7, host),
            row("mesh-only", 8, "[]"),
        ];
        assert!(routes_via_gateway(&rows[0].config));
        assert_eq!(
            pass_order(rows),
            [
                vec!["b", "gateway", "mesh-only"],
                vec!["a-behind", "c-behind"]
            ]
        );
    }

    #[test]
    fn only_vms_applied_without_error_converge_together() {
        let host = r#"[{"destination":"0.0.0.0/0","via":"host"}]"#;
        let synced = |id, uid| {
            let mut r = row(id, uid, host);
            r.applied = Some(r.config.clone());
            r
        };
        let mut failed = synced("failed", 2);
        failed.last_error = Some("boom".into());
        let mut changed = synced("changed", 3);
        changed.config = changed.config.replace("fdaa:1::3", "fdaa:1::33");
        let fresh = row("fresh", 4, host);
        let (t, alone) = together(vec![synced("a", 1), failed, changed, fresh, synced("b", 5)]);
        let ids = |v: Vec<VmRow>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(t), ["a", "b"]);
        assert_eq!(ids(alone), ["failed", "changed", "fresh"]);
    }
}
