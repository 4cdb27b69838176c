//! `vmnet up --sandbox` / `vmnet down --sandbox`: the main job in throwaway namespaces.

use vmnet_model::Error;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct UpArgs {}

/// Runs the command.
pub async fn run(_g: &Global, _args: UpArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}

/// Arguments of `vmnet down`.
#[derive(Debug, clap::Args)]
pub struct DownArgs {}

/// Runs `vmnet down`.
pub async fn down(_g: &Global, _args: DownArgs) -> Result<(), Error> {
    Err(Error::internal("not implemented yet"))
}
