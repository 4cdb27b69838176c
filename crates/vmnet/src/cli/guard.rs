//! The guest guard's counters as `vmnet vm show` and `vmnet status` print them.

/// The non-zero drop counters, `kind n, …`, or `none`.
pub(crate) fn drops_text(drops: &std::collections::BTreeMap<String, u64>) -> String {
    let d: Vec<String> = drops
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    if d.is_empty() {
        "none".to_owned()
    } else {
        d.join(", ")
    }
}

/// `off`, or the VMs guarded and the non-zero drop counters.
pub(crate) fn guest_guard_line(g: Option<&vmnet_agent::api::types::GuestGuardStatus>) -> String {
    let Some(g) = g else {
        return "off (--no-guest-guard)".to_owned();
    };
    if let Some(e) = &g.error {
        return format!("drops unreadable: {e}");
    }
    let mut line = format!("{} VMs; drops: {}", g.vms, drops_text(&g.drops));
    if g.unregistered > 0 {
        line.push_str(&format!("; {} on unregistered taps", g.unregistered));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmnet_agent::api::types::GuestGuardStatus;

    #[test]
    fn only_the_counters_that_moved_are_printed() {
        let g = GuestGuardStatus {
            vms: 3,
            drops: [("arp".to_owned(), 2), ("mac".to_owned(), 0)]
                .into_iter()
                .collect(),
            unregistered: 0,
            error: None,
        };
        assert_eq!(guest_guard_line(Some(&g)), "3 VMs; drops: arp 2");
        assert_eq!(guest_guard_line(None), "off (--no-guest-guard)");
        let quiet = GuestGuardStatus {
            unregistered: 4,
            ..GuestGuardStatus::default()
        };
        assert_eq!(
            guest_guard_line(Some(&quiet)),
            "0 VMs; drops: none; 4 on unregistered taps"
        );
    }
}
