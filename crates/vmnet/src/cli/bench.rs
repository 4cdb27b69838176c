//! `vmnet bench …`: benchmarks that print a table.

use clap::Subcommand;
use vmnet_model::Error;

use crate::Global;

/// `vmnet bench …`
#[derive(Debug, Subcommand)]
pub enum BenchCmd {}

/// Runs `vmnet bench …`.
pub async fn run(_g: &Global, c: BenchCmd) -> Result<(), Error> {
    match c {}
}
