//! The `vmnet` command: the agent (`serve`), the CLI client, the IPAM commands, the sandbox
//! (`up --sandbox`, `down --sandbox`) and the benchmarks (`bench`).
//!
//! Errors print once, as `error: CODE: message` on stderr, and the process exits with the code's
//! documented exit status ([`vmnet_model::ErrorCode::exit_code`]).

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use vmnet_agent::api::error::from_ipam;
use vmnet_bench::BenchError;
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
    Bench(vmnet_bench::BenchCmd),
    /// Run the agent: HTTP API on a unix socket and the reconcile loop.
    Serve(Box<cli::serve::ServeArgs>),
    /// VM network configs held by the agent (namespace mode).
    #[command(subcommand)]
    Vm(cli::vm::VmCmd),
    /// The mesh's WireGuard interface (`vmnet serve --mesh`).
    #[command(subcommand)]
    Mesh(cli::mesh::MeshCmd),
    /// The agent's status.
    Status,
    /// Apply a host spec (pools, instances and VMs in one file) declaratively.
    Apply(cli::vm::ApplyArgs),
    /// Create a sandbox host and run the main job inside it.
    Up(vmnet_sandbox::args::UpArgs),
    /// Remove a sandbox made by `vmnet up --sandbox`.
    Down(vmnet_sandbox::args::DownArgs),
    /// Background processes of the sandbox (frame relay, echo service); internal.
    #[command(subcommand, hide = true, name = "sandbox-helper")]
    SandboxHelper(vmnet_sandbox::helper::HelperCmd),
}

fn main() -> ExitCode {
    restore_sigpipe();
    raise_nofile_limit();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    // `serve --netns NAME` moves the process into NAME on the main thread, before any other
    // thread (the runtime's) exists, so the whole agent lives there without forking.
    if let Command::Serve(a) = &cli.command
        && let Err(e) = cli::serve::enter_netns(a)
    {
        return report(&e);
    }
    // Before the runtime's threads exist: few malloc arenas keep the agent's RSS small. The
    // benchmarks run the agent's driver in this process, so they get the same allocator.
    if matches!(cli.command, Command::Serve(_) | Command::Bench(_)) {
        let _ = vmnet_agent::malloc::limit_arenas();
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
        // Each attempt is one transaction; one that failed on a deadlock or serialization
        // conflict with a concurrent writer (the agent) runs again.
        Command::Pool(c) => vmnet_ipam::retry(|| cli::ipam::pool(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Host(c) => vmnet_ipam::retry(|| cli::ipam::host(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Instance(c) => vmnet_ipam::retry(|| cli::ipam::instance(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Lease(c) => vmnet_ipam::retry(|| cli::ipam::lease(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Bench(c) => vmnet_bench::run(g.output == Output::Json, c)
            .await
            .map_err(from_bench),
        Command::Serve(a) => cli::serve::run(g, *a).await,
        Command::Vm(c) => cli::vm::vm(g, c).await,
        Command::Mesh(c) => cli::mesh::mesh(g, c).await,
        Command::Status => cli::vm::status(g).await,
        Command::Apply(a) => cli::vm::apply(g, a).await,
        Command::Up(a) => vmnet_sandbox::up::run(g.output == Output::Json, a).await,
        Command::Down(a) => vmnet_sandbox::up::down(g.output == Output::Json, a).await,
        Command::SandboxHelper(c) => vmnet_sandbox::helper::run(c),
    }
}

/// Restores the default `SIGPIPE` disposition (terminate), which the Rust runtime sets to
/// ignore: `vmnet … --output json | head -5` then ends quietly when the reader goes away,
/// as other Unix tools do, instead of panicking in `println!` on `EPIPE`.
fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, while the process has one thread and no signal
    // handlers of its own; `SIG_DFL` is a valid disposition for `SIGPIPE` and the call touches
    // no memory.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Raises the soft limit of open files (`RLIMIT_NOFILE`) to the hard limit. The agent (and a
/// bench running its driver) keeps descriptors per VM — the metadata listener and the nf_tables
/// generation socket of each VM netns — so 1,000 VMs take over 2,000, past the soft limit of
/// 1,024 a service manager usually sets. A failure leaves the limit as it was (logged later by
/// whatever runs out).
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Reports a command-line parsing error in the documented shape: `--help` and `--version`
/// print as clap prints them and exit 0; anything else prints
/// `error: INVALID_INPUT: <clap's message>` followed by clap's usage and `--help` hint on
/// stderr (a missing subcommand: `error: INVALID_INPUT: a subcommand is required` and the
/// help), and exits with INVALID_INPUT's exit status (2).
fn usage_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        // Printing fails only when stdout is gone; nothing useful is left to do then.
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    let rendered = e.render().to_string();
    let text = if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        // `vmnet` or `vmnet host` alone: clap renders the help; say what is missing first.
        format!("a subcommand is required\n\n{rendered}")
    } else {
        rendered
            .strip_prefix("error: ")
            .unwrap_or(&rendered)
            .to_owned()
    };
    eprint!("error: {}: {text}", ErrorCode::InvalidInput);
    if !text.ends_with('\n') {
        eprintln!();
    }
    report_code(ErrorCode::InvalidInput)
}

/// A benchmark's failure as the wire error: IPAM failures through the one IPAM mapping
/// ([`from_ipam`]), validation failures as `INVALID_INPUT`, coded ones as they are.
fn from_bench(e: BenchError) -> Error {
    match e {
        BenchError::Ipam(e) => from_ipam(e),
        BenchError::Invalid(e) => e.into(),
        BenchError::Coded(e) => e,
    }
}

fn report(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    report_code(e.code)
}

/// The process exit status of an error code ([`ErrorCode::exit_code`]).
fn report_code(code: ErrorCode) -> ExitCode {
    let status: u8 = code.exit_code().try_into().unwrap_or(1);
    if code == ErrorCode::Internal {
        ExitCode::FAILURE
    } else {
        ExitCode::from(status)
    }
}
