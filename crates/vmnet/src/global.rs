//! The options every command accepts, client and agent alike.

use std::path::PathBuf;

use crate::Output;

/// Options every command accepts.
#[derive(Debug, Clone, clap::Args)]
pub struct Global {
    /// Database URL: `sqlite://PATH` or `postgres://…`. Default: a SQLite file under --state-dir.
    #[arg(long, global = true, env = "VMNET_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Directory for vmnet's own state (the default SQLite database lives here).
    #[arg(
        long,
        global = true,
        env = "VMNET_STATE_DIR",
        default_value = "/var/lib/vmnet"
    )]
    pub state_dir: PathBuf,
    /// The agent's unix socket, for client commands.
    #[arg(
        long,
        global = true,
        env = "VMNET_SOCKET",
        default_value = "/run/vmnet/vmnet.sock"
    )]
    pub socket: PathBuf,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

impl Global {
    /// The database URL to use: --database-url, or `sqlite://<state-dir>/vmnet.db`.
    #[must_use]
    pub fn database_url(&self) -> String {
        self.database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", self.state_dir.join("vmnet.db").display()))
    }
}
