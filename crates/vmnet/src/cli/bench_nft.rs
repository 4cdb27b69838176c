//! `vmnet bench nft`: pool-mode ruleset apply and per-instance add/remove cost.

use vmnet_model::Error;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct NftBenchArgs {}

/// Runs the command.
pub async fn run(_g: &Global, _args: NftBenchArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
