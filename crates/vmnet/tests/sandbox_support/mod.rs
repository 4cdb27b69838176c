//! What the single-host sandbox tests share: running the built `vmnet` binary, and a guard that
//! takes the sandbox down even when a test fails half-way.

use std::path::PathBuf;
use std::process::{Command, Output};

use vmnet_testkit::sandbox;

/// Runs the built `vmnet` with `args` and waits for it.
pub fn vmnet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(args)
        .output()
        .expect("run vmnet")
}

/// Runs `vmnet down --sandbox` for sandbox `name` under `root`, then sweeps its namespaces, on
/// drop.
pub struct Guard {
    /// The sandbox name.
    pub name: String,
    /// Its `--root`.
    pub root: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let root = self.root.display().to_string();
        let _ = vmnet(&["down", "--sandbox", "--name", &self.name, "--root", &root]);
        let _ = sandbox::cleanup(&self.name);
    }
}
