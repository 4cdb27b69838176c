//! `vmnet completions SHELL` and `vmnet man --dir DIR`: shell completions and manual pages made
//! from the command's own clap definitions (`clap_complete`, `clap_mangen`), so they list
//! exactly the commands and flags this `vmnet` takes. Packages ship both (docs: cli.md).

use std::path::PathBuf;

use clap::CommandFactory;
use vmnet_model::Error;

use crate::full::Cli;

/// Arguments of `vmnet completions`.
#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish (or elvish, powershell).
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Arguments of `vmnet man`.
#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// The directory to write the pages in (made when missing): `vmnet.1` and one page per
    /// subcommand (`vmnet-serve.1`, `vmnet-vm-put.1`, …).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
}

/// Prints the completion script for a shell on stdout.
///
/// # Errors
/// `UNAVAILABLE` when standard output cannot take it.
pub fn completions(args: &CompletionsArgs) -> Result<(), Error> {
    let mut cmd = without_nested_help(Cli::command());
    // Made in memory first: the generator panics on a write error of its own.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "vmnet", &mut script);
    vmnet_cli::out(format_args!("{}", String::from_utf8_lossy(&script)))
}

/// `cmd` with the `help` subcommands below the top level taken out: `vmnet` (the client binary)
/// has only the top level's `help`, so a completion offers what both binaries take.
fn without_nested_help(cmd: clap::Command) -> clap::Command {
    cmd.mut_subcommands(|sub| {
        let sub = sub.disable_help_subcommand(true);
        sub.mut_subcommands(|s| without_nested_help(s.disable_help_subcommand(true)))
    })
}

/// Writes the manual pages into `--dir`, then prints their paths.
///
/// # Errors
/// `UNAVAILABLE` naming the directory when it cannot be made or written.
pub fn man(args: &ManArgs) -> Result<(), Error> {
    let failed =
        |e: std::io::Error| Error::unavailable(format!("man --dir {}: {e}", args.dir.display()));
    std::fs::create_dir_all(&args.dir).map_err(failed)?;
    clap_mangen::generate_to(Cli::command(), &args.dir).map_err(failed)?;
    let mut pages: Vec<_> = std::fs::read_dir(&args.dir)
        .map_err(failed)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    pages.sort();
    for p in pages {
        vmnet_cli::outln!("{}", p.display())?;
    }
    Ok(())
}
