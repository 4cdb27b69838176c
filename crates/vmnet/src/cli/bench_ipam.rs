//! `vmnet bench ipam`: lease/release latency and throughput on SQLite and PostgreSQL.

use vmnet_model::Error;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct IpamBenchArgs {}

/// Runs the command.
pub async fn run(_g: &Global, _args: IpamBenchArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
