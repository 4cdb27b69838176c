//! The client commands' input and output: a file (or stdin) read up to a limit, and JSON
//! printed so that a write error is the command's error.

use std::path::PathBuf;

use vmnet_model::Error;

/// Reads `path` (`-`: stdin), at most `limit` bytes; returns the name errors give it and the
/// bytes.
///
/// # Errors
/// `INVALID_INPUT` naming the file when it cannot be read or is larger than `limit`.
pub fn read_file(path: &PathBuf, limit: u64) -> Result<(String, Vec<u8>), Error> {
    let name = path.display().to_string();
    let stdin = name == "-";
    let name = if stdin { "stdin".to_owned() } else { name };
    let bytes = if stdin {
        vmnet_cli::read_at_most(std::io::stdin().lock(), limit)
    } else {
        std::fs::File::open(path).and_then(|f| vmnet_cli::read_at_most(f, limit))
    };
    let bytes = bytes.map_err(|e| Error::invalid(format!("{name}: cannot read: {e}")))?;
    Ok((name, bytes))
}

/// Prints `v` as pretty JSON on stdout.
///
/// # Errors
/// `UNAVAILABLE` when stdout cannot take it.
pub fn print_json<T: serde::Serialize>(v: &T) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::internal(format!("cannot encode output: {e}")))?;
    vmnet_cli::outln!("{text}")
}
