//! Throughput limits of a VM (spec: namespaced-vm-networking.md, "Throughput limits").
//!
//! `private_network_throughput_mibps` and `public_network_throughput_mibps` are whole MiB/s
//! (1 MiB/s = 1,048,576 bytes of IP packets per second: the IP header and everything after it,
//! not the Ethernet header), `0..=`[`MAX_THROUGHPUT_MIBPS`]; 0 (the default) is unlimited. Each
//! applies in both directions, seen from the VM: what the guest sends and what it receives.

use serde_json::{Map, Value};

use crate::ValidationError;

/// The largest limit, MiB/s.
pub const MAX_THROUGHPUT_MIBPS: u32 = 100_000;

/// The field of the private limit.
pub const PRIVATE_FIELD: &str = "private_network_throughput_mibps";
/// The field of the public limit.
pub const PUBLIC_FIELD: &str = "public_network_throughput_mibps";

/// Reads one limit field of a VM config object: absent or `null` is 0 (unlimited).
///
/// # Errors
/// `INVALID_INPUT` naming the VM and the field, for a negative, fractional, non-numeric or too
/// large value.
pub fn parse_limit(
    vm: &str,
    top: &Map<String, Value>,
    field: &str,
) -> Result<u32, ValidationError> {
    let bad = |what: String| {
        ValidationError::rule(format!(
            "vm {vm}: {field} {what}; it must be a whole number of MiB/s in 0..={MAX_THROUGHPUT_MIBPS} (0 = unlimited)"
        ))
    };
    match top.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) => u32::try_from(v)
                .ok()
                .filter(|v| *v <= MAX_THROUGHPUT_MIBPS)
                .ok_or_else(|| bad(format!("{v} is too large"))),
            None if n.as_i64().is_some() => Err(bad(format!("{n} is negative"))),
            // A float (a decimal point or an exponent, or beyond u64/i64): a whole one is judged
            // by its size first, and one in range is refused for how it is written.
            None => match n.as_f64() {
                Some(f) if f.fract() == 0.0 && f > f64::from(MAX_THROUGHPUT_MIBPS) => {
                    Err(bad(format!("{n} is too large")))
                }
                Some(f) if f.fract() == 0.0 && f < 0.0 => Err(bad(format!("{n} is negative"))),
                Some(f) if f.fract() == 0.0 => Err(bad(format!(
                    "{n} is written with a decimal point or an exponent (write {f:.0})"
                ))),
                _ => Err(bad(format!("{n} is not a whole number"))),
            },
        },
        Some(v) => Err(bad(format!("must be a number, got {v}"))),
    }
}

/// Checks a limit already held in a [`super::VmConfig`].
///
/// # Errors
/// `INVALID_INPUT` naming the VM and the field.
pub fn check_limit(vm: &str, field: &str, v: u32) -> Result<(), ValidationError> {
    if v > MAX_THROUGHPUT_MIBPS {
        return Err(ValidationError::rule(format!(
            "vm {vm}: {field} {v} is too large; it must be a whole number of MiB/s in 0..={MAX_THROUGHPUT_MIBPS} (0 = unlimited)"
        )));
    }
    Ok(())
}

/// serde's `skip_serializing_if` for a limit: 0 (unlimited) is not written.
#[must_use]
#[allow(clippy::trivially_copy_pass_by_ref)]
pub fn is_unlimited(v: &u32) -> bool {
    *v == 0
}
