//! The VM config's `metadata` object: which version of the metadata service (MMDS) the VM's
//! guest talks to (spec: namespaced-vm-networking.md, "Atlas WG Mesh", the MMDS paragraph).
//!
//! ```json
//! {"metadata": {"version": "v2"}}
//! ```
//!
//! - `version`: `"v1"` (requests without a session token are answered) or `"v2"` (every `GET`
//!   needs a token from `PUT /latest/api/token`). Absent (or `metadata` absent) means the host's
//!   default (`vmnet serve --metadata-version`).
//! - Unknown fields are refused (`INVALID_INPUT`, naming the VM and the field path).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::ValidationError;

/// The metadata service version a guest talks to (Firecracker's MMDS versions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MetadataVersion {
    /// Version 1: a `GET` without a session token is answered; a token, when sent, must be valid.
    V1,
    /// Version 2: every `GET` carries a valid session token (`X-metadata-token`).
    #[default]
    V2,
}

impl fmt::Display for MetadataVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        })
    }
}

impl FromStr for MetadataVersion {
    type Err = String;

    /// Parses `v1` or `v2` (lower case, as written in configs and on the command line).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "v1" => Ok(Self::V1),
            "v2" => Ok(Self::V2),
            _ => Err(format!(
                "{s:?} is not a metadata version; use \"v1\" or \"v2\""
            )),
        }
    }
}

impl Serialize for MetadataVersion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MetadataVersion {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The `metadata` object of a VM config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MetadataConfig {
    /// The version; `None` is the host's default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<MetadataVersion>,
}

/// Reads the `metadata` field of a VM config (`None` when absent or `null`).
///
/// # Errors
/// `INVALID_INPUT` naming the VM and the field path, for a non-object, an unknown field or a
/// version other than `v1`/`v2`.
pub fn parse(vm: &str, v: Option<&Value>) -> Result<Option<MetadataConfig>, ValidationError> {
    let bad = |field: &str, msg: &str| ValidationError::rule(format!("vm {vm}: {field} {msg}"));
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(bad("metadata", &format!("must be an object, got {v}"))),
    };
    if let Some(k) = o.keys().find(|k| k.as_str() != "version") {
        return Err(bad(&format!("metadata.{k}"), "is an unknown field"));
    }
    let version = match o.get("version") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.parse().map_err(|m: String| bad("metadata.version", &m))?),
        Some(v) => {
            return Err(bad(
                "metadata.version",
                &format!("must be \"v1\" or \"v2\", got {v}"),
            ));
        }
    };
    Ok(Some(MetadataConfig { version }))
}
