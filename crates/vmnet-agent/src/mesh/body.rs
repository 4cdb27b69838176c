//! The body of `POST /v1/sync`, validated as a whole before anything changes (pure code).
//!
//! Rules (each refusal is `INVALID_INPUT` naming the peer or entry and the field):
//! - at most [`MAX_PEERS`] peers and [`MAX_WHITELIST`] whitelist entries;
//! - a public key is 32 bytes in standard base64 (44 characters), unique in the body, and never
//!   the host's own key;
//! - an endpoint is `address:port`, an IPv6 address in brackets, port 1-65535, the address a
//!   unicast one (not unspecified, not multicast);
//! - a mesh address lies in `fdaa::/16`, is not the host's own mesh address, and belongs to one
//!   peer only (two peers claiming one address name both: WireGuard would silently move the
//!   allowed IP to the last one);
//! - a whitelist entry is an IPv6 address or prefix inside `fdaa::/16`, written once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ipnet::Ipv6Net;
use serde::{Deserialize, Serialize};
use vmnet_model::Error;

/// The most peers one sync may carry.
pub const MAX_PEERS: usize = 10_000;
/// The most whitelist entries one sync may carry.
pub const MAX_WHITELIST: usize = 65_536;

/// The mesh range: every mesh address lies in it.
#[must_use]
pub fn mesh_range() -> Ipv6Net {
    Ipv6Net::new(Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, 0), 16).unwrap_or_default()
}

/// A WireGuard key (public or private): 32 bytes, shown as standard base64.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WgKey(pub [u8; 32]);

impl WgKey {
    /// The key as lowercase hex (the UAPI's form).
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&STANDARD.encode(self.0))
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgKey({self})")
    }
}

impl FromStr for WgKey {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bytes = STANDARD
            .decode(s)
            .map_err(|e| format!("{s:?} is not base64 ({e})"))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|b: Vec<u8>| format!("{s:?} decodes to {} bytes, not 32", b.len()))?;
        Ok(Self(arr))
    }
}

/// One managed peer: another host of the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    /// Its public key.
    pub public_key: WgKey,
    /// Its address on the private network and its listen port.
    pub endpoint: SocketAddr,
    /// Its mesh address: the peer's only allowed IP (/128) and the destination of its route.
    pub mesh_address: Ipv6Addr,
}

/// A validated sync: the complete managed peer set and the tenant-0 whitelist, both in a
/// canonical order (peers by key, whitelist sorted).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SyncBody {
    /// The peers, ordered by public key.
    pub peers: Vec<PeerSpec>,
    /// The whitelist, sorted, each entry once.
    pub whitelist: Vec<Ipv6Net>,
}

/// The wire form of one peer (strings, checked by [`validate`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPeer {
    /// Base64 public key.
    pub public_key: String,
    /// `address:port`, IPv6 in brackets.
    pub endpoint: String,
    /// An address in fdaa::/16.
    pub mesh_address: String,
}

/// The wire form of the body.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSync {
    /// The complete managed peer set.
    pub peers: Vec<RawPeer>,
    /// The tenant-0 whitelist (absent means empty).
    #[serde(default)]
    pub whitelist: Vec<String>,
}

/// What the body is checked against: the host's own key and mesh address.
#[derive(Debug, Clone, Copy)]
pub struct Own {
    /// The host's public key.
    pub public_key: WgKey,
    /// The host's mesh address, when it has one.
    pub mesh_address: Option<Ipv6Addr>,
}

/// Parses and validates a JSON body (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` naming the peer (by index and key) or whitelist entry and the field.
pub fn parse_sync(body: &[u8], own: &Own) -> Result<SyncBody, Error> {
    // Strict: a peer with two `public_key`s (or any repeated key) is refused, not last-wins.
    let value: serde_json::Value = vmnet_model::json::from_slice(body)
        .map_err(|e| Error::invalid(format!("sync body: {e}")))?;
    if !value.is_object() {
        return Err(Error::invalid(
            "sync body: expected a JSON object {\"peers\": [...], \"whitelist\": [...]}",
        ));
    }
    let raw: RawSync =
        serde_json::from_value(value).map_err(|e| Error::invalid(format!("sync body: {e}")))?;
    validate(&raw, own)
}

fn parse_endpoint(s: &str) -> Result<SocketAddr, String> {
    // `SocketAddr` parsing already wants brackets around IPv6 and a port.
    let ep = SocketAddr::from_str(s).map_err(|_| {
        format!("{s:?} is not address:port (IPv4, or IPv6 in brackets: [fd00::2]:51820)")
    })?;
    if ep.port() == 0 {
        return Err(format!("{s:?}: port 0 is not a listen port"));
    }
    let ip = ep.ip();
    if ip.is_unspecified() || ip.is_multicast() || matches!(ip, IpAddr::V4(v) if v.is_broadcast()) {
        return Err(format!("{s:?}: {ip} is not a unicast address"));
    }
    if let SocketAddr::V6(v6) = ep
        && (v6.scope_id() != 0 || v6.flowinfo() != 0)
    {
        return Err(format!("{s:?}: a zone or flow label is not accepted"));
    }
    Ok(ep)
}

/// Validates a parsed body (see the module docs).
///
/// # Errors
/// As [`parse_sync`].
pub fn validate(raw: &RawSync, own: &Own) -> Result<SyncBody, Error> {
    if raw.peers.len() > MAX_PEERS {
        return Err(Error::invalid(format!(
            "sync: {} peers, at most {MAX_PEERS} are accepted",
            raw.peers.len()
        )));
    }
    if raw.whitelist.len() > MAX_WHITELIST {
        return Err(Error::invalid(format!(
            "sync: {} whitelist entries, at most {MAX_WHITELIST} are accepted",
            raw.whitelist.len()
        )));
    }
    let range = mesh_range();
    let mut peers = Vec::with_capacity(raw.peers.len());
    let mut by_key: BTreeMap<WgKey, usize> = BTreeMap::new();
    let mut by_mesh: BTreeMap<Ipv6Addr, usize> = BTreeMap::new();
    for (i, p) in raw.peers.iter().enumerate() {
        // Names are made only for an error: a valid sync of 10,000 peers formats nothing.
        let key = WgKey::from_str(&p.public_key)
            .map_err(|e| Error::invalid(format!("sync: peers[{i}].public_key: {e}")))?;
        let name = || format!("peers[{i}] ({key})");
        if key == own.public_key {
            return Err(Error::invalid(format!(
                "sync: {}.public_key is this host's own key; a host is not its own peer",
                name()
            )));
        }
        if let Some(j) = by_key.insert(key, i) {
            return Err(Error::invalid(format!(
                "sync: {}.public_key is also peers[{j}]'s; each peer appears once",
                name()
            )));
        }
        let endpoint = parse_endpoint(&p.endpoint)
            .map_err(|e| Error::invalid(format!("sync: {}.endpoint: {e}", name())))?;
        let mesh = Ipv6Addr::from_str(&p.mesh_address).map_err(|_| {
            Error::invalid(format!(
                "sync: {}.mesh_address: {:?} is not an IPv6 address",
                name(),
                p.mesh_address
            ))
        })?;
        if !range.contains(&mesh) {
            return Err(Error::invalid(format!(
                "sync: {}.mesh_address: {mesh} is not in {range}",
                name()
            )));
        }
        if Some(mesh) == own.mesh_address {
            return Err(Error::invalid(format!(
                "sync: {}.mesh_address: {mesh} is this host's own mesh address",
                name()
            )));
        }
        if let Some(j) = by_mesh.insert(mesh, i) {
            return Err(Error::invalid(format!(
                "sync: {}.mesh_address: {mesh} is claimed by peers[{j}] ({}) and peers[{i}] ({key}); a mesh address belongs to one peer only",
                name(),
                peers
                    .get(j)
                    .map(|q: &PeerSpec| q.public_key.to_string())
                    .unwrap_or_default()
            )));
        }
        peers.push(PeerSpec {
            public_key: key,
            endpoint,
            mesh_address: mesh,
        });
    }
    peers.sort_by_key(|p| p.public_key);
    let mut whitelist = BTreeSet::new();
    for (i, w) in raw.whitelist.iter().enumerate() {
        let net = match Ipv6Net::from_str(w) {
            Ok(n) => n,
            Err(_) => match Ipv6Addr::from_str(w) {
                Ok(a) => Ipv6Net::from(a),
                Err(_) => {
                    return Err(Error::invalid(format!(
                        "sync: whitelist[{i}]: {w:?} is not an IPv6 address or prefix"
                    )));
                }
            },
        };
        if net != net.trunc() {
            return Err(Error::invalid(format!(
                "sync: whitelist[{i}]: {w:?} has host bits set (write {})",
                net.trunc()
            )));
        }
        if !range.contains(&net) {
            return Err(Error::invalid(format!(
                "sync: whitelist[{i}]: {net} is not in {range}"
            )));
        }
        if !whitelist.insert(net) {
            return Err(Error::invalid(format!(
                "sync: whitelist[{i}]: {net} is listed twice"
            )));
        }
    }
    Ok(SyncBody {
        peers,
        whitelist: whitelist.into_iter().collect(),
    })
}

#[cfg(test)]
#[path = "body_tests.rs"]
mod tests;
