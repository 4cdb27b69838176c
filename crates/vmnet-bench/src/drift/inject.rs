//! The changes `vmnet-lab bench drift` makes to what the agent owns: each is what an operator's
//! command or another program would do (`nft`, `ip`, `tc` inside the VM's namespace or the
//! sandbox host's), one object at a time.

use std::time::{Duration, Instant};

use vmnet_model::Error;
use vmnet_plan::ns::VmPlan;
use vmnet_sandbox::netns;

/// How long one command may take.
const CMD: Duration = Duration::from_secs(10);

/// A kind of change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// The VM's NAT rule deleted from its netns table.
    NatRule,
    /// One rule of the VM's firewall deleted.
    FirewallRule,
    /// The host's route to the VM's public IPv4 deleted.
    HostRoute,
    /// The public HTB class on the VM's veth end deleted (its filters first).
    HtbClass,
    /// The VM's veth end set down.
    VethDown,
    /// The guest guard's BPF filter deleted from the tap.
    GuardFilter,
}

impl Kind {
    /// Every kind, in the order changes cycle through them.
    pub const ALL: [Self; 6] = [
        Self::NatRule,
        Self::FirewallRule,
        Self::HostRoute,
        Self::HtbClass,
        Self::VethDown,
        Self::GuardFilter,
    ];

    /// The row label.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::NatRule => "NAT rule deleted",
            Self::FirewallRule => "firewall rule deleted",
            Self::HostRoute => "host route to public IPv4 deleted",
            Self::HtbClass => "HTB class (and filters) deleted",
            Self::VethDown => "VM veth end set down",
            Self::GuardFilter => "guard's BPF filter on tap deleted",
        }
    }

    /// Whether the change needs a VM with a public IPv4 (its NAT rule and its host route).
    #[must_use]
    pub fn needs_public_v4(self) -> bool {
        matches!(self, Self::NatRule | Self::HostRoute)
    }
}

fn failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("drift bench: {what}: {e}"))
}

fn exec(ns: &str, program: &str, args: &[&str]) -> Result<String, Error> {
    let out = netns::exec(ns, program, args, CMD).map_err(|e| failed(program, e))?;
    if !out.status.success() {
        return Err(failed(
            &format!("{program} {} in {ns}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The VM's netns table as `nft -a list table` prints it (rules with their handles).
///
/// # Errors
/// `INTERNAL` when `nft` fails.
pub fn table(plan: &VmPlan) -> Result<String, Error> {
    exec(
        &plan.netns,
        "nft",
        &["-a", "list", "table", "inet", &plan.name_prefix],
    )
}

/// The chain and handle of the first rule of `inet table` whose line holds every needle, from
/// an `nft -a list table` listing.
#[must_use]
pub fn rule_handle(listing: &str, needles: &[&str]) -> Option<(String, String)> {
    let mut chain = None;
    for line in listing.lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("chain ") {
            chain = c.split_whitespace().next().map(str::to_owned);
        } else if needles.iter().all(|n| line.contains(n))
            && let Some((_, handle)) = line.rsplit_once("# handle ")
        {
            return Some((chain?, handle.trim().to_owned()));
        }
    }
    None
}

/// The preference of the BPF filter in a `tc filter show` listing.
#[must_use]
pub fn bpf_pref(listing: &str) -> Option<String> {
    listing
        .lines()
        .find(|l| l.contains(" bpf "))
        .and_then(|l| l.split_whitespace().skip_while(|w| *w != "pref").nth(1))
        .map(str::to_owned)
}

/// Makes change `kind` to VM `plan` (`host`: the sandbox host's netns). Returns the instant
/// just before the command that made the change ran (what the repair is timed from).
///
/// # Errors
/// `INTERNAL` when the object is not there or a command fails.
pub fn inject(kind: Kind, plan: &VmPlan, host: &str) -> Result<Instant, Error> {
    let ns = plan.netns.as_str();
    let table = plan.name_prefix.as_str();
    let peer = plan
        .veth
        .as_ref()
        .map(|v| v.peer_name.clone())
        .ok_or_else(|| failed("plan", "the VM has no veth"))?;
    let delete_rule = |needles: &[&str]| -> Result<Instant, Error> {
        let listing = self::table(plan)?;
        let (chain, handle) = rule_handle(&listing, needles)
            .ok_or_else(|| failed("nft", format!("no rule with {needles:?} in {ns}")))?;
        let t = Instant::now();
        exec(
            ns,
            "nft",
            &["delete", "rule", "inet", table, &chain, "handle", &handle],
        )?;
        Ok(t)
    };
    match kind {
        Kind::NatRule => delete_rule(&["snat"]),
        // The bench firewall's inbound rules allow TCP from a list of prefixes.
        Kind::FirewallRule => delete_rule(&["tcp dport", "accept"]),
        Kind::HostRoute => {
            let public = plan
                .public
                .as_ref()
                .and_then(|p| p.ipv4)
                .ok_or_else(|| failed("plan", "the VM has no public IPv4"))?;
            let t = Instant::now();
            exec(host, "ip", &["route", "del", &public.to_string()])?;
            Ok(t)
        }
        Kind::HtbClass => {
            // A class with a filter pointing to it cannot be deleted: the filters go first
            // (a repair puts back both).
            let t = Instant::now();
            let _ = exec(ns, "tc", &["filter", "del", "dev", &peer]);
            exec(ns, "tc", &["class", "del", "dev", &peer, "classid", "1:20"])?;
            Ok(t)
        }
        Kind::VethDown => {
            let t = Instant::now();
            exec(ns, "ip", &["link", "set", &peer, "down"])?;
            Ok(t)
        }
        Kind::GuardFilter => {
            let tap = plan.tap.name.as_str();
            let listing = exec(ns, "tc", &["filter", "show", "dev", tap, "ingress"])?;
            let pref = bpf_pref(&listing)
                .ok_or_else(|| failed("tc", format!("no BPF filter on {tap}")))?;
            let t = Instant::now();
            exec(
                ns,
                "tc",
                &["filter", "del", "dev", tap, "ingress", "pref", &pref],
            )?;
            Ok(t)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_is_found_by_its_needles_in_its_chain() {
        let listing = "table inet vmn { # handle 3\n\tchain postrouting { # handle 2\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\toifname \"vmh0001\" snat ip to 192.0.2.1 # handle 7\n\t}\n\tchain fw_in { # handle 4\n\t\tip saddr 198.51.100.0/24 tcp dport 22 accept # handle 9\n\t}\n}\n";
        assert_eq!(
            rule_handle(listing, &["snat"]),
            Some(("postrouting".into(), "7".into()))
        );
        assert_eq!(
            rule_handle(listing, &["tcp dport", "accept"]),
            Some(("fw_in".into(), "9".into()))
        );
        assert_eq!(rule_handle(listing, &["dnat"]), None);
    }

    #[test]
    fn the_bpf_filters_preference_is_read() {
        let listing = "filter protocol all pref 49152 bpf chain 0 \nfilter protocol all pref 49152 bpf chain 0 handle 0x1 guest_guard direct-action not_in_hw id 7 tag 1\n";
        assert_eq!(bpf_pref(listing).as_deref(), Some("49152"));
        assert_eq!(bpf_pref("filter protocol all pref 1 u32 chain 0"), None);
    }
}
