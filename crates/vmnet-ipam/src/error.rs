//! The one error type of the IPAM and the stores: [`IpamError`].
//!
//! Each variant says what went wrong in IPAM's own terms; the documented code (`NOT_FOUND`,
//! `CAPACITY_UNAVAILABLE`, …) is chosen at the edge that answers a caller (the agent's API, the
//! CLI), not here. Causes (the database's error, the JSON parser's) are `#[source]`s, kept out of
//! the message; `vmnet_model::error::chain` writes them out.

use vmnet_model::ValidationError;

/// The message of a transaction that failed on a deadlock (SQLSTATE `40P01`) or a serialization
/// conflict (`40001`) every time it ran: [`transaction!`](crate::transaction) and
/// [`retry`](crate::retry) run such a transaction again; the caller sees [`IpamError::Busy`] only
/// when every attempt failed so.
pub const BUSY: &str = "the store is busy with concurrent changes; try again";

/// A failure of an IPAM or store operation.
#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    /// The request breaks a validation rule (a bad id, a bad range, zero vcpus).
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// The named object does not exist; `object` is e.g. `pool p1`.
    #[error("{object} not found")]
    NotFound {
        /// The kind and id of the object, e.g. `instance i-1`.
        object: String,
    },
    /// The request conflicts with stored state: an object that exists already, ranges that
    /// overlap, a lease held in another pool, a user id or mesh address in use. The message
    /// names both sides.
    #[error("{0}")]
    Conflict(String),
    /// No room for the request: a range with no free address, no host with room, a lost host.
    #[error("{0}")]
    Exhausted(String),
    /// Concurrent requests kept winning a race this one has to retry (e.g. addresses taken by
    /// concurrent placements); the request may succeed if sent again.
    #[error("{0}")]
    Contended(String),
    /// A transaction failed on a deadlock or serialization conflict on every attempt ([`BUSY`]).
    #[error("{BUSY}")]
    Busy,
    /// The database failed a request. `what` is a sentence of ours (the database's own words
    /// name internals and stay in `source`, which is logged, not answered).
    #[error("{what}")]
    Database {
        /// What failed, e.g. `the database refused the request (SQLSTATE 23514); the details are logged`.
        what: String,
        /// The database driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The database at the configured URL cannot be reached or opened.
    #[error("cannot connect to the database")]
    Connect(#[source] sqlx::Error),
    /// The embedded migrations failed to run.
    #[error("database migration")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The database URL names a scheme other than `sqlite:` and `postgres:`.
    #[error("database_url {url:?} must start with sqlite:// or postgres://")]
    UnknownScheme {
        /// The URL as given.
        url: String,
    },
    /// The database URL does not parse.
    #[error("database_url {url:?}")]
    Url {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: sqlx::Error,
    },
    /// A file system step before opening the database failed (creating its directory).
    #[error("{what}")]
    Io {
        /// What was attempted, e.g. `cannot create database directory /var/lib/vmnet`.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A stored value does not decode (a bug or a corrupt database).
    #[error("{0}")]
    Corrupt(String),
    /// A value does not encode to or decode from its stored JSON form (a bug or a corrupt
    /// database).
    #[error("{what}")]
    Json {
        /// The value, e.g. `stored conditions "[…"`.
        what: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

impl IpamError {
    /// [`IpamError::Invalid`] with `message` (naming the object and the field).
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(ValidationError::rule(message))
    }

    /// [`IpamError::NotFound`] for `object` (kind and id, e.g. `host h1`).
    pub fn not_found(object: impl Into<String>) -> Self {
        Self::NotFound {
            object: object.into(),
        }
    }

    /// Whether this is [`IpamError::Busy`] (worth running the whole transaction again).
    #[must_use]
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Busy)
    }
}

/// An error type a [`transaction!`](crate::transaction) body may return: it holds every
/// [`IpamError`] and tells whether it is [`IpamError::Busy`].
pub trait TxError: From<IpamError> {
    /// Whether the transaction that failed with this error is worth running again.
    fn is_busy(&self) -> bool;
}

impl TxError for IpamError {
    fn is_busy(&self) -> bool {
        IpamError::is_busy(self)
    }
}

#[cfg(test)]
mod tests {
    use vmnet_model::error::chain;

    use super::*;

    #[test]
    fn not_found_names_the_object() {
        assert_eq!(
            IpamError::not_found("pool p1").to_string(),
            "pool p1 not found"
        );
    }

    #[test]
    fn invalid_is_the_validation_message() {
        let e = IpamError::invalid("host h1: vcpus must be at least 1");
        assert_eq!(chain(&e), "host h1: vcpus must be at least 1");
        assert!(matches!(e, IpamError::Invalid(_)));
    }

    #[test]
    fn a_database_error_prints_its_source_once() {
        let e = IpamError::Database {
            what: "the database is unreachable; try again".into(),
            source: sqlx::Error::PoolClosed,
        };
        assert_eq!(e.to_string(), "the database is unreachable; try again");
        let text = chain(&e);
        let cause = sqlx::Error::PoolClosed.to_string();
        assert_eq!(
            text,
            format!("the database is unreachable; try again: {cause}")
        );
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
    }

    #[test]
    fn url_errors_say_what_is_wrong() {
        let e = IpamError::UnknownScheme {
            url: "mysql://x".into(),
        };
        assert_eq!(
            e.to_string(),
            r#"database_url "mysql://x" must start with sqlite:// or postgres://"#
        );
        let bad = IpamError::Url {
            url: "sqlite://".into(),
            source: sqlx::Error::Configuration("no file".into()),
        };
        assert!(
            chain(&bad).starts_with(r#"database_url "sqlite://": "#),
            "{}",
            chain(&bad)
        );
    }
}
