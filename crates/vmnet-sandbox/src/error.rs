//! The one error type of the test kit.

use std::time::Duration;

/// A test-kit failure, naming what was attempted.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A system call or file operation failed.
    #[error("{what}")]
    Io {
        /// What was attempted, e.g. `netns sb1-host: setns`.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An external command exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// Something did not happen within its time limit.
    #[error("{what}: no answer within {timeout:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit.
        timeout: Duration,
    },
    /// An answer or a state was not what the protocol allows.
    #[error("{0}")]
    Unexpected(String),
    /// A helper thread panicked.
    #[error("{0}: helper thread panicked")]
    Panicked(String),
}

impl SandboxError {
    /// An [`SandboxError::Io`] from `what` and a nix errno.
    pub fn errno(what: impl Into<String>, e: nix::Error) -> Self {
        Self::Io {
            what: what.into(),
            source: std::io::Error::from_raw_os_error(e as i32),
        }
    }

    /// An [`SandboxError::Io`] from `what` and an I/O error.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}
