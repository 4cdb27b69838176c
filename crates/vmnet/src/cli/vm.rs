//! Client commands talking to the agent's API: `vmnet vm …`, `vmnet status`, `vmnet apply FILE`.

use clap::Subcommand;
use vmnet_model::Error;

use crate::Global;

/// `vmnet vm …`
#[derive(Debug, Subcommand)]
pub enum VmCmd {}

/// Arguments of `vmnet apply`.
#[derive(Debug, clap::Args)]
pub struct ApplyArgs {}

/// Runs `vmnet vm …`.
pub async fn vm(_g: &Global, c: VmCmd) -> Result<(), Error> {
    match c {}
}

/// Runs `vmnet status`.
pub async fn status(_g: &Global) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}

/// Runs `vmnet apply FILE`.
pub async fn apply(_g: &Global, _args: ApplyArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
