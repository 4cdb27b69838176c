//! The trust boundaries of `vmnet serve` (docs: security.md): who may use the API socket
//! (`--socket-group`), where provider credentials may be read (`--credentials-dir`) and where
//! they may be sent (`https://` unless `--allow-plain-http-providers`), the unprivileged worker
//! (`--worker-user`; the hidden `--worker-serve` is the worker process itself), and how long a
//! change may wait for the kernel (`--kernel-deadline-secs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use vmnet_agent::agent::Agent;
use vmnet_agent::provider::http::HttpSettings;
use vmnet_agent::server;
use vmnet_agent::worker::{Worker, WorkerSettings, WorkerUser};
use vmnet_model::Error;
use vmnet_model::pool::{DEFAULT_CREDENTIALS_DIR, ProviderRules};

use super::logs::LogFormat;

/// The trust-boundary flags of `vmnet serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrustArgs {
    /// The group whose members may use the API socket besides root (a name or a gid): the
    /// socket is made `root:GROUP` mode 0660, and every connection's peer must be root or a
    /// member of the group (its own gid or a supplementary group of its user); others are
    /// refused and logged. Default: root only.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
    /// The only directory provider pools' `credentials.file` may name a file in; files are
    /// opened without following symbolic links or leaving it.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CREDENTIALS_DIR)]
    pub credentials_dir: PathBuf,
    /// Allow provider pools with an `http://` `api_url` (the pool's secret then crosses the
    /// network in clear text): for a local test server only. Default: `https://` only.
    #[arg(long)]
    pub allow_plain_http_providers: bool,
    /// The unprivileged user the worker runs as (the metadata service and the provider polls):
    /// a user name, or `UID:GID`; never root.
    #[arg(long, value_name = "USER", default_value = vmnet_agent::worker::DEFAULT_USER)]
    pub worker_user: String,
    /// How long a VM change through the API may wait for the kernel (the kernel lock, then its
    /// apply) before it answers UNAVAILABLE naming what it waited for.
    #[arg(long, default_value_t = vmnet_agent::agent::DEFAULT_KERNEL_DEADLINE_SECS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub kernel_deadline_secs: u64,
    /// Internal: run as the unprivileged worker `UID:GID` on descriptor 3 (started by the
    /// agent).
    #[arg(long, hide = true, value_name = "UID:GID")]
    pub worker_serve: Option<String>,
}

impl TrustArgs {
    /// Who may use the API socket.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming `--socket-group` when no such group exists.
    pub fn access(&self) -> Result<server::Access, Error> {
        Ok(server::Access {
            group: match &self.socket_group {
                Some(spec) => Some(server::access::resolve_group(spec).map_err(Error::invalid)?),
                None => None,
            },
        })
    }

    /// The rules for provider pools.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming `--credentials-dir`.
    pub fn provider_rules(&self) -> Result<ProviderRules, Error> {
        let dir = self.credentials_dir.to_str().ok_or_else(|| {
            Error::invalid(format!(
                "--credentials-dir {}: not UTF-8",
                self.credentials_dir.display()
            ))
        })?;
        Ok(ProviderRules::new(dir, self.allow_plain_http_providers)?)
    }
}

/// When this process is the worker (`--worker-serve`): serves the agent and exits; never
/// returns then. Call on the main thread before the runtime starts.
pub fn worker_entry(args: &TrustArgs, log_format: LogFormat) {
    let Some(ids) = &args.worker_serve else {
        return;
    };
    super::logs::init_worker(log_format);
    let code = match vmnet_agent::worker::child::main(ids) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vmnet worker: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Starts the worker as `--worker-user` and records it on the agent.
///
/// # Errors
/// `INVALID_INPUT` for an unknown or root user; `UNAVAILABLE` when the worker does not start.
pub async fn start_worker(
    args: &TrustArgs,
    log_format: LogFormat,
    agent: &Agent,
    http: HttpSettings,
) -> Result<Arc<Worker>, Error> {
    let user = WorkerUser::lookup(&args.worker_user).map_err(Error::invalid)?;
    let exe = vmnet_agent::worker::vmnet_exe()
        .map_err(|e| Error::unavailable(format!("the worker: this executable: {e}")))?;
    let worker = Worker::start(WorkerSettings {
        command: vmnet_agent::worker::command_with(exe, vec![format!("--log-format={log_format}")]),
        user,
        http,
    })
    .await?;
    agent.set_worker(Arc::clone(&worker))?;
    Ok(worker)
}

/// Takes other users' access away from a SQLite store (`sqlite://PATH`: the file and its `-wal`
/// and `-shm` companions lose their `o-rwx` bits), so that no other local user, the worker's
/// included, can read the store. A PostgreSQL store is the server's to protect.
pub fn protect_store(database_url: &str) {
    use std::os::unix::fs::PermissionsExt;
    let Some(rest) = database_url.strip_prefix("sqlite://") else {
        return;
    };
    let path = rest.split('?').next().unwrap_or(rest);
    for p in [
        path.to_owned(),
        format!("{path}-wal"),
        format!("{path}-shm"),
    ] {
        let Ok(meta) = std::fs::metadata(&p) else {
            continue;
        };
        let mode = meta.permissions().mode();
        if mode & 0o007 != 0 {
            match std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & !0o007)) {
                Ok(()) => {
                    tracing::info!(file = %p, "the store is no longer readable by other users")
                }
                Err(e) => {
                    tracing::warn!(file = %p, "cannot take other users' access to the store away: {e}")
                }
            }
        }
    }
}

/// The kernel deadline as a duration.
#[must_use]
pub fn kernel_deadline(args: &TrustArgs) -> Duration {
    Duration::from_secs(args.kernel_deadline_secs)
}
