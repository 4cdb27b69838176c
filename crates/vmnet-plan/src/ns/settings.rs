//! The host-level settings of namespace mode ([`NsSettings`]) and their validation.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use vmnet_model::ValidationError;
use vmnet_model::vm::MAX_USER_ID;

use super::names;
use super::topology::{GATEWAY_IPV4, MAIN_TABLE, TAP_PREFIX_LEN};

/// Host-level settings of namespace mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NsSettings {
    /// The prefix of every derived name (`--name-prefix`), see [`names::check_prefix`]. Default `vmn`.
    pub name_prefix: String,
    /// The transit range; VM `uid` gets the /30 at offset `4·uid`. Default `10.200.0.0/14`, which
    /// holds one /30 for each of the 2^16 supported user ids. A smaller range supports fewer ids.
    pub transit_ipv4: Ipv4Net,
    /// The owner uid of each tap (the VMM's user); `None` leaves it root-only.
    pub tap_owner_uid: Option<u32>,
    /// The owner gid of each tap; `None` sets none.
    pub tap_owner_gid: Option<u32>,
    /// The MTU of the veth pair and the tap, bytes. Default 1380.
    pub mtu: u32,
    /// VM `uid` uses host routing table `host_table_base + uid`. Default `0x0100_0000`.
    pub host_table_base: u32,
    /// The priority of the per-VM host rules. Default 10000.
    pub host_rule_priority: u32,
    /// Whether the driver enables forwarding and masquerades the transit range in the host
    /// netns ([`HostPlan`](super::HostPlan)). Default true.
    pub manage_host: bool,
    /// The uplink interface (`--uplink`), where proxy ARP/NDP entries live. Default none.
    pub uplink: Option<String>,
    /// How the upstream reaches public addresses (`--public-neighbors`). Default routed.
    pub public_neighbors: super::public::PublicNeighbors,
    /// Whether each VM gets a packet-activity entry ([`super::activity`]); the agent turns it
    /// on when it has loaded the activity program (`--activity-root`). Default false.
    pub activity: bool,
    /// Whether each VM's tap gets the guest guard ([`super::guard`]); the agent turns it on
    /// when it has loaded the guard program (unless `--no-guest-guard`). Default false.
    pub guard: bool,
}

impl Default for NsSettings {
    fn default() -> Self {
        Self {
            name_prefix: "vmn".into(),
            transit_ipv4: Ipv4Net::new(Ipv4Addr::new(10, 200, 0, 0), 14).expect("valid prefix"),
            tap_owner_uid: None,
            tap_owner_gid: None,
            mtu: 1380,
            host_table_base: 0x0100_0000,
            host_rule_priority: 10000,
            manage_host: true,
            uplink: None,
            public_neighbors: super::public::PublicNeighbors::Routed,
            activity: false,
            guard: false,
        }
    }
}

impl NsSettings {
    /// The largest user id these settings support: limited by the names (0xffff) and by the
    /// number of /30s in the transit range.
    #[must_use]
    pub fn max_user_id(&self) -> u32 {
        let slots_log2 = 30u32.saturating_sub(u32::from(self.transit_ipv4.prefix_len()));
        let by_range = if slots_log2 >= 32 {
            u32::MAX
        } else {
            (1u32 << slots_log2) - 1
        };
        by_range.min(MAX_USER_ID)
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the setting.
    pub fn validate(&self) -> Result<(), ValidationError> {
        names::check_prefix(&self.name_prefix)
            .map_err(|m| ValidationError::rule(format!("settings: {m}")))?;
        if self.transit_ipv4.trunc() != self.transit_ipv4 || self.transit_ipv4.prefix_len() > 30 {
            return Err(ValidationError::rule(format!(
                "settings: transit_ipv4 {} must be a canonical prefix of length 30 or shorter",
                self.transit_ipv4
            )));
        }
        let guest_net = Ipv4Net::new(GATEWAY_IPV4, TAP_PREFIX_LEN)
            .expect("valid")
            .trunc();
        if self.transit_ipv4.contains(&guest_net)
            || guest_net.contains(&self.transit_ipv4.network())
        {
            return Err(ValidationError::rule(format!(
                "settings: transit_ipv4 {} overlaps the guest network {guest_net}",
                self.transit_ipv4
            )));
        }
        if self.public_neighbors == super::public::PublicNeighbors::Proxy && self.uplink.is_none() {
            return Err(ValidationError::rule(
                "settings: public_neighbors proxy needs an uplink (--uplink IFACE) to answer ARP/NDP on",
            ));
        }
        if let Some(u) = &self.uplink
            && (u.is_empty() || u.len() > names::IFNAME_MAX || u.contains(['/', ' ']))
        {
            return Err(ValidationError::rule(format!(
                "settings: uplink {u:?} is not an interface name (1..=15 bytes, no '/' or space)"
            )));
        }
        if !(1280..=9000).contains(&self.mtu) {
            return Err(ValidationError::rule(format!(
                "settings: mtu {} must be in 1280..=9000",
                self.mtu
            )));
        }
        if self
            .host_table_base
            .checked_add(MAX_USER_ID)
            .is_none_or(|t| t >= 0xffff_ff00)
            || self.host_table_base <= MAIN_TABLE
        {
            return Err(ValidationError::rule(format!(
                "settings: host_table_base {} leaves no room for 65536 tables above 255",
                self.host_table_base
            )));
        }
        Ok(())
    }

    /// The transit /30 of `uid` (network address `transit + 4·uid`).
    #[must_use]
    pub fn transit_of(&self, uid: u32) -> Ipv4Net {
        let base = u32::from(self.transit_ipv4.network());
        Ipv4Net::new(Ipv4Addr::from(base + 4 * uid), 30).expect("30 is a valid length")
    }

    /// The user id whose netns transit address (the second address of its /30, see
    /// [`Self::transit_of`]) is `addr`; `None` for any other address.
    #[must_use]
    pub fn uid_of_transit(&self, addr: Ipv4Addr) -> Option<u32> {
        let off = u32::from(addr).checked_sub(u32::from(self.transit_ipv4.network()) + 2)?;
        let uid = off / 4;
        (off % 4 == 0
            && uid <= vmnet_model::vm::MAX_USER_ID
            && self.transit_of(uid).contains(&addr))
        .then_some(uid)
    }
}
