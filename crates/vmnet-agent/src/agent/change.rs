//! What kind of change a PUT makes to a VM's config: the agent applies a firewall-only change by
//! replacing the VM's netns table (or its rules), a limits-only change by changing its HTB
//! classes in place and a change of the public IPv4 or mapped IPv6 alone by changing the VM's
//! public mapping only, instead of a full apply.

use vmnet_model::vm::VmConfig;

/// How a PUT applies a changed config of a VM whose last apply succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// The throughput limits only: the HTB classes changed in place.
    Limits,
    /// The firewall only: its rules (or the VM's netns table) replaced.
    Firewall,
    /// The public IPv4 or mapped IPv6 only: the public mapping changed.
    Public,
    /// Anything else (or nothing: an unchanged config is applied, and so checked, in full).
    Full,
}

impl Kind {
    /// The name the log gives it (the field `apply`).
    pub(super) const fn as_str(self) -> &'static str {
        match self {
            Self::Limits => "limits",
            Self::Firewall => "firewall",
            Self::Public => "public",
            Self::Full => "full",
        }
    }

    /// The kind of the change from `old` (the applied config) to `new`.
    pub(super) fn of(old: &VmConfig, new: &VmConfig) -> Self {
        if limits_only_change(old, new) {
            Self::Limits
        } else if firewall_only_change(old, new) {
            Self::Firewall
        } else if public_only_change(old, new) {
            Self::Public
        } else {
            Self::Full
        }
    }
}

/// Whether `new` differs from `old` in its firewall only (and does differ).
fn firewall_only_change(old: &VmConfig, new: &VmConfig) -> bool {
    let same_rest = VmConfig {
        firewall: new.firewall.clone(),
        ..old.clone()
    };
    same_rest == *new && old != new
}

/// Whether `new` differs from `old` in its throughput limits only (and does differ).
fn limits_only_change(old: &VmConfig, new: &VmConfig) -> bool {
    let same_rest = VmConfig {
        private_network_throughput_mibps: new.private_network_throughput_mibps,
        public_network_throughput_mibps: new.public_network_throughput_mibps,
        ..old.clone()
    };
    same_rest == *new && old != new
}

/// Whether `new` differs from `old` in its public IPv4 or public IPv6 address only (and does
/// differ), neither of them holding a routed IPv6 block (a block also changes the netns's routes
/// and the firewall's guest addresses: a full apply).
fn public_only_change(old: &VmConfig, new: &VmConfig) -> bool {
    let same_rest = VmConfig {
        public_ipv4: new.public_ipv4,
        public_ipv6: new.public_ipv6,
        ..old.clone()
    };
    same_rest == *new
        && old != new
        && old.public_ipv6_block().is_none()
        && new.public_ipv6_block().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> VmConfig {
        serde_json::from_str(&format!(
            r#"{{"id":"a","user_id":1,"tenant":1,"mesh_ipv6":"fdaa:1::1"{extra},
            "network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}},
            {{"destination":"::/0","via":"host"}}]}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn a_public_address_change_alone_is_a_public_change() {
        let none = cfg("");
        let v4 = cfg(r#","public_ipv4":"192.0.2.7""#);
        let both = cfg(r#","public_ipv4":"192.0.2.8","public_ipv6":"2001:db8::8""#);
        assert!(public_only_change(&none, &v4));
        assert!(public_only_change(&v4, &none));
        assert!(public_only_change(&v4, &both));
        assert!(!public_only_change(&v4, &v4), "no change");
        let block = cfg(r#","public_ipv6":"2001:db8:1::/56""#);
        assert!(!public_only_change(&none, &block), "a block changes routes");
        assert!(!public_only_change(&block, &none));
        let other = VmConfig {
            tenant: 2,
            ..v4.clone()
        };
        assert!(!public_only_change(&none, &other), "the tenant changed too");
        assert_eq!(Kind::of(&none, &v4), Kind::Public);
        assert_eq!(Kind::of(&none, &block), Kind::Full);
        assert_eq!(Kind::of(&v4, &v4), Kind::Full);
    }
}
