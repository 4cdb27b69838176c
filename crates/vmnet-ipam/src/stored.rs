//! Values as the store holds them: IPv4 addresses as integers (`ip_free`, `ip_leases.address_num`),
//! IPv6 addresses as 16 bytes big-endian (`ip6_free`, `ip6_leases.address_bytes`),
//! and as text. A leaf module: the range, free-index, lease, placement and report modules share
//! these conversions.

use std::net::Ipv4Addr;
use std::str::FromStr;

use crate::error::IpamError;

/// An address as the integer stored in `ip_free` and `ip_leases.address_num`.
pub(crate) fn num(a: Ipv4Addr) -> i64 {
    i64::from(u32::from(a))
}

/// The address of a stored integer.
pub(crate) fn addr(n: i64) -> Result<Ipv4Addr, IpamError> {
    u32::try_from(n)
        .map(Ipv4Addr::from)
        .map_err(|_| IpamError::Corrupt(format!("stored address {n} is out of range")))
}

/// Parses a value the store holds as text; a value that does not parse is `INTERNAL` (the store
/// only ever holds what vmnet wrote), naming `what`.
pub(crate) fn parse_stored<T: FromStr>(what: &str, s: &str) -> Result<T, IpamError> {
    T::from_str(s).map_err(|_| IpamError::Corrupt(format!("stored {what} {s:?} does not parse")))
}

/// An IPv6 address (or any 128-bit address number) as the 16 bytes big-endian stored in
/// `ip6_free` and `ip6_leases.address_bytes`; they sort like the numbers.
pub(crate) fn bytes6(n: u128) -> Vec<u8> {
    n.to_be_bytes().to_vec()
}

/// The number of 16 stored bytes.
pub(crate) fn num6(b: &[u8]) -> Result<u128, IpamError> {
    <[u8; 16]>::try_from(b)
        .map(u128::from_be_bytes)
        .map_err(|_| IpamError::Corrupt(format!("stored IPv6 value has {} bytes, not 16", b.len())))
}
