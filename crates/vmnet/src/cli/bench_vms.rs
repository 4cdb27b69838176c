//! `vmnet bench vms`: per-VM setup/teardown latency against the shell baseline, in a sandbox.

use vmnet_model::Error;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct VmsBenchArgs {}

/// Runs the command.
pub async fn run(_g: &Global, _args: VmsBenchArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
