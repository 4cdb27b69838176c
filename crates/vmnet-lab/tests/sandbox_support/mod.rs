//! What the sandbox tests share: running the built `vmnet-lab` binary and the product's `vmnet`
//! beside it, and a guard that takes the sandbox down even when a test fails half-way.
//!
//! `vmnet-lab up` starts the agent from the `vmnet` binary in its own directory, so that binary
//! must be built too: `cargo build -p vmnet` (scripts/test.sh builds every binary first).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use vmnet_testkit::sandbox;

/// The lab binary under test.
pub const LAB: &str = env!("CARGO_BIN_EXE_vmnet-lab");

/// The product binary the lab runs the agent from: `vmnet` beside [`LAB`] (canonical path).
pub fn vmnet_bin() -> PathBuf {
    let p = PathBuf::from(LAB).with_file_name("vmnet");
    std::fs::canonicalize(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: the sandbox runs the agent from it; build it first (`cargo build -p vmnet`)",
            p.display()
        )
    })
}

/// Runs the built `vmnet-lab` with `args` and waits for it.
pub fn lab(args: &[&str]) -> Output {
    Command::new(LAB)
        .args(args)
        .output()
        .expect("run vmnet-lab")
}

/// Runs the product's `vmnet` client against the agent at `socket` and waits for it.
pub fn client(socket: &str, args: &[&str]) -> Output {
    Command::new(vmnet_bin())
        .args(args)
        .env("VMNET_SOCKET", socket)
        .output()
        .expect("run vmnet")
}

/// Runs `vmnet-lab down --sandbox` for sandbox `name` under `root`, then sweeps its namespaces,
/// on drop.
pub struct Guard {
    /// The sandbox name.
    pub name: String,
    /// Its `--root`.
    pub root: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let root = self.root.display().to_string();
        let _ = lab(&["down", "--sandbox", "--name", &self.name, "--root", &root]);
        let _ = sandbox::cleanup(&self.name);
    }
}
