//! `vmnet pool|host|instance|lease …`: IPAM commands against the store.

use clap::Subcommand;
use vmnet_model::Error;

use crate::Global;

/// `vmnet pool …`
#[derive(Debug, Subcommand)]
pub enum PoolCmd {}
/// `vmnet host …`
#[derive(Debug, Subcommand)]
pub enum HostCmd {}
/// `vmnet instance …`
#[derive(Debug, Subcommand)]
pub enum InstanceCmd {}
/// `vmnet lease …`
#[derive(Debug, Subcommand)]
pub enum LeaseCmd {}

/// Runs `vmnet pool …`.
pub async fn pool(_g: &Global, c: PoolCmd) -> Result<(), Error> {
    match c {}
}
/// Runs `vmnet host …`.
pub async fn host(_g: &Global, c: HostCmd) -> Result<(), Error> {
    match c {}
}
/// Runs `vmnet instance …`.
pub async fn instance(_g: &Global, c: InstanceCmd) -> Result<(), Error> {
    match c {}
}
/// Runs `vmnet lease …`.
pub async fn lease(_g: &Global, c: LeaseCmd) -> Result<(), Error> {
    match c {}
}
