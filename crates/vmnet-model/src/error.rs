//! The documented error codes, the wire error every layer maps into at the edge, and the
//! model's own [`ValidationError`].
//!
//! Each failure vmnet reports carries an [`ErrorCode`] (the stable, documented string such as
//! `INVALID_INPUT`) and a human message that names the object and the field at fault. The HTTP
//! API maps a code to a status exactly once ([`ErrorCode::http_status`]); the CLI maps it to an
//! exit code exactly once ([`ErrorCode::exit_code`]).
//!
//! # Design
//! Layers return their own error enums (this crate's [`ValidationError`], `vmnet_ipam::IpamError`,
//! …), each with a short message and its cause as `#[source]`. The wire type [`Error`] (code plus
//! message, serde) is made only at an edge: the API answer, the CLI's exit, a tool's report. The
//! model's own enum maps to its code here ([`From<ValidationError> for Error`](Error#impl-From<ValidationError>-for-Error));
//! the other crates' enums map in the agent's API edge module. [`chain`] is the one way a
//! message and its causes are printed.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A documented error code. Serialized in `SCREAMING_SNAKE_CASE` (`"INVALID_INPUT"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The request is malformed or breaks a validation rule (HTTP 400, exit code 2).
    InvalidInput,
    /// The named object does not exist (HTTP 404, exit code 3).
    NotFound,
    /// The object exists already or the request conflicts with current state (HTTP 409, exit code 4).
    Conflict,
    /// No capacity (addresses, host resources) is free for the request (HTTP 503, exit code 5).
    CapacityUnavailable,
    /// A dependency (database, kernel) failed; the request may succeed later (HTTP 503, exit code 6).
    Unavailable,
    /// The path exists but does not serve the request's method (HTTP 405 with an `Allow`
    /// header, exit code 2): an API-only code, never made from a validation rule.
    MethodNotAllowed,
    /// A bug or an unexpected state inside vmnet (HTTP 500, exit code 1).
    Internal,
}

impl ErrorCode {
    /// The documented string form, e.g. `"CAPACITY_UNAVAILABLE"`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidInput => "INVALID_INPUT",
            Self::NotFound => "NOT_FOUND",
            Self::Conflict => "CONFLICT",
            Self::CapacityUnavailable => "CAPACITY_UNAVAILABLE",
            Self::Unavailable => "UNAVAILABLE",
            Self::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            Self::Internal => "INTERNAL",
        }
    }

    /// The HTTP status the API answers with for this code (400, 404, 405, 409, 503 or 500).
    #[must_use]
    pub const fn http_status(self) -> u16 {
        match self {
            Self::InvalidInput => 400,
            Self::NotFound => 404,
            Self::Conflict => 409,
            Self::CapacityUnavailable | Self::Unavailable => 503,
            Self::MethodNotAllowed => 405,
            Self::Internal => 500,
        }
    }

    /// The process exit code the CLI ends with for this code (documented in the README).
    #[must_use]
    pub const fn exit_code(self) -> i32 {
        match self {
            Self::Internal => 1,
            Self::InvalidInput | Self::MethodNotAllowed => 2,
            Self::NotFound => 3,
            Self::Conflict => 4,
            Self::CapacityUnavailable => 5,
            Self::Unavailable => 6,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its documented code and a message naming the object and field.
///
/// Displayed as `CODE: message`, the form the CLI prints after `error: `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{code}: {message}")]
pub struct Error {
    /// The documented code.
    pub code: ErrorCode,
    /// A sentence naming the object and the field, e.g. `pool p1: first_host 10.0.1.2 is outside cidr 10.0.0.0/24`.
    pub message: String,
}

impl Error {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// `INVALID_INPUT` with `message`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidInput, message)
    }

    /// `NOT_FOUND` with `message`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// `CONFLICT` with `message`.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }

    /// `CAPACITY_UNAVAILABLE` with `message`.
    pub fn capacity(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::CapacityUnavailable, message)
    }

    /// `UNAVAILABLE` with `message`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unavailable, message)
    }

    /// `INTERNAL` with `message`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

/// Input that breaks a validation rule: the one error type of the model's parsers and
/// validators. Every variant is `INVALID_INPUT` at the edge.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    /// A rule about one object or field; the message names both, e.g.
    /// `pool p1: cidr 10.0.0.1/24 has host bits set`.
    #[error("{0}")]
    Rule(String),
    /// A document that is not valid JSON or does not fit its schema; `what` names the document
    /// (e.g. `vm: malformed JSON`), the parser's words are the source.
    #[error("{what}")]
    Json {
        /// The document and what was wrong with it.
        what: String,
        /// The JSON parser's error.
        #[source]
        source: serde_json::Error,
    },
}

impl ValidationError {
    /// A [`ValidationError::Rule`] with `message` (naming the object and the field).
    pub fn rule(message: impl Into<String>) -> Self {
        Self::Rule(message.into())
    }

    /// The message with its cause, as one line (see [`chain`]).
    #[must_use]
    pub fn message(&self) -> String {
        chain(self)
    }

    /// The error with a message about a VM document that could not name the VM (`vm: …`:
    /// malformed JSON, not an object) naming it as `vm <id>: …`, for a caller that knows the id
    /// from elsewhere (the request's path).
    #[must_use]
    pub fn naming_vm(self, id: &str) -> Self {
        let name = |m: String| match m.strip_prefix("vm: ") {
            Some(rest) => format!("vm {id}: {rest}"),
            None => m,
        };
        match self {
            Self::Rule(m) => Self::Rule(name(m)),
            Self::Json { what, source } => Self::Json {
                what: name(what),
                source,
            },
        }
    }
}

/// The edge mapping of the model's validation errors: always `INVALID_INPUT`, the message with
/// its cause ([`chain`]).
impl From<ValidationError> for Error {
    fn from(e: ValidationError) -> Self {
        Self::new(ErrorCode::InvalidInput, chain(&e))
    }
}

/// An error and each of its sources, `: `-separated, outermost first: the one way vmnet prints an
/// error chain (e.g. `tap bc1: create: Operation not permitted (os error 1)`).
///
/// Typed errors (thiserror, `#[source]`) keep their cause out of their own message; this is
/// where the causes are written out, once, when the error is turned into a message for a
/// caller or a log.
#[must_use]
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test error with an optional cause.
    #[derive(Debug, thiserror::Error)]
    #[error("{what}")]
    struct Step {
        what: &'static str,
        #[source]
        cause: Option<Box<Step>>,
    }

    fn step(what: &'static str, cause: Option<Step>) -> Step {
        Step {
            what,
            cause: cause.map(Box::new),
        }
    }

    #[test]
    fn chain_of_one_is_its_message() {
        assert_eq!(chain(&step("tap bc1", None)), "tap bc1");
    }

    #[test]
    fn chain_lists_every_source_outermost_first() {
        let e = step(
            "pool firewall",
            Some(step("nft", Some(step("EPERM", None)))),
        );
        assert_eq!(e.to_string(), "pool firewall");
        assert_eq!(chain(&e), "pool firewall: nft: EPERM");
        let io = std::io::Error::from_raw_os_error(1);
        let boxed: Box<dyn std::error::Error> = Box::new(io);
        assert_eq!(
            chain(boxed.as_ref()),
            "Operation not permitted (os error 1)"
        );
    }

    #[test]
    fn codes_serialize_as_documented() {
        let json = serde_json::to_string(&ErrorCode::CapacityUnavailable).unwrap();
        assert_eq!(json, "\"CAPACITY_UNAVAILABLE\"");
        assert_eq!(ErrorCode::InvalidInput.http_status(), 400);
        assert_eq!(ErrorCode::NotFound.http_status(), 404);
        assert_eq!(ErrorCode::Conflict.http_status(), 409);
        assert_eq!(ErrorCode::CapacityUnavailable.http_status(), 503);
        assert_eq!(ErrorCode::MethodNotAllowed.http_status(), 405);
        assert_eq!(
            serde_json::to_string(&ErrorCode::MethodNotAllowed).unwrap(),
            "\"METHOD_NOT_ALLOWED\""
        );
    }

    #[test]
    fn validation_errors_map_to_invalid_input_with_their_cause_once() {
        let e = ValidationError::rule("pool p1: cidr 10.0.0.1/24 has host bits set");
        let wire = Error::from(e);
        assert_eq!(wire.code, ErrorCode::InvalidInput);
        assert_eq!(wire.message, "pool p1: cidr 10.0.0.1/24 has host bits set");
        let source = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let json = ValidationError::Json {
            what: "vm: malformed JSON".into(),
            source,
        };
        assert_eq!(json.to_string(), "vm: malformed JSON");
        let named = ValidationError::Json {
            what: "vm: malformed JSON".into(),
            source: serde_json::from_str::<serde_json::Value>("{").unwrap_err(),
        }
        .naming_vm("web-7");
        assert_eq!(named.to_string(), "vm web-7: malformed JSON");
        let rule = ValidationError::rule("vm a: mtu 70 is below 1280").naming_vm("b");
        assert_eq!(
            rule.to_string(),
            "vm a: mtu 70 is below 1280",
            "a named VM stays named"
        );
        let wire = Error::from(json);
        assert_eq!(wire.code, ErrorCode::InvalidInput);
        assert_eq!(
            wire.message,
            "vm: malformed JSON: EOF while parsing an object at line 1 column 1"
        );
    }

    #[test]
    fn display_is_code_then_message() {
        let e = Error::invalid("pool p1: cidr 10.0.0.1/24 has host bits set");
        assert_eq!(
            e.to_string(),
            "INVALID_INPUT: pool p1: cidr 10.0.0.1/24 has host bits set"
        );
    }
}
