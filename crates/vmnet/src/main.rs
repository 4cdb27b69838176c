//! The `vmnet` command: the agent (`serve`), the CLI client, the IPAM commands, the sandbox
//! (`up --sandbox`, `down --sandbox`) and the benchmarks (`bench`).
//!
//! Errors print once, as `error: CODE: message` on stderr, and the process exits with the code's
//! documented exit status ([`vmnet_model::ErrorCode::exit_code`]).

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use vmnet_model::{Error, ErrorCode};

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Output {
    /// A human table (the default).
    #[default]
    Table,
    /// JSON, one document per command.
    Json,
}

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

#[derive(Debug, Parser)]
#[command(
    name = "vmnet",
    version,
    about = "Host networking for virtual machines"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pool ranges (IPAM).
    #[command(subcommand)]
    Pool(cli::ipam::PoolCmd),
    /// Hosts and their capacity.
    #[command(subcommand)]
    Host(cli::ipam::HostCmd),
    /// Instances: placement with a lease.
    #[command(subcommand)]
    Instance(cli::ipam::InstanceCmd),
    /// Leases of a pool.
    #[command(subcommand)]
    Lease(cli::ipam::LeaseCmd),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(cli::bench::BenchCmd),
    /// Run the agent: HTTP API on a unix socket and the reconcile loop.
    Serve(cli::serve::ServeArgs),
    /// VM network configs held by the agent (namespace mode).
    #[command(subcommand)]
    Vm(cli::vm::VmCmd),
    /// The agent's status.
    Status,
    /// Apply a host spec (pools, instances and VMs in one file) declaratively.
    Apply(cli::vm::ApplyArgs),
    /// Create a sandbox host and run the main job inside it.
    Up(cli::sandbox::UpArgs),
    /// Remove a sandbox made by `vmnet up --sandbox`.
    Down(cli::sandbox::DownArgs),
    /// Background processes of the sandbox (frame relay, echo service); internal.
    #[command(subcommand, hide = true, name = "sandbox-helper")]
    SandboxHelper(cli::sandbox::HelperCmd),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve --netns NAME` moves the process into NAME on the main thread, before any other
    // thread (the runtime's) exists, so the whole agent lives there without forking.
    if let Command::Serve(a) = &cli.command
        && let Err(e) = cli::serve::enter_netns(a)
    {
        return report(&e);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return report(&Error::internal(format!("cannot start the runtime: {e}"))),
    };
    let result = runtime.block_on(run(cli));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report(&e),
    }
}

async fn run(cli: Cli) -> Result<(), Error> {
    let g = &cli.global;
    match cli.command {
        Command::Pool(c) => cli::ipam::pool(g, c).await,
        Command::Host(c) => cli::ipam::host(g, c).await,
        Command::Instance(c) => cli::ipam::instance(g, c).await,
        Command::Lease(c) => cli::ipam::lease(g, c).await,
        Command::Bench(c) => cli::bench::run(g, c).await,
        Command::Serve(a) => cli::serve::run(g, a).await,
        Command::Vm(c) => cli::vm::vm(g, c).await,
        Command::Status => cli::vm::status(g).await,
        Command::Apply(a) => cli::vm::apply(g, a).await,
        Command::Up(a) => cli::sandbox::run(g, a).await,
        Command::Down(a) => cli::sandbox::down(g, a).await,
        Command::SandboxHelper(c) => cli::sandbox::helper(c),
    }
}

fn report(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    let code: u8 = e.code.exit_code().try_into().unwrap_or(1);
    if e.code == ErrorCode::Internal {
        ExitCode::FAILURE
    } else {
        ExitCode::from(code)
    }
}
