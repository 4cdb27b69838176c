//! `vmnet serve`: run the agent (HTTP API on a unix socket, reconcile loop).

use vmnet_model::Error;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {}

/// Runs the command.
pub async fn run(_g: &Global, _args: ServeArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
