//! A provider pool's secret: read at every poll from the agent's credentials directory (or an
//! environment variable of the agent), held in a [`SecretString`] (its `Debug` redacts it, its
//! memory is zeroed when dropped), and exposed only to build the `Authorization` header.
//!
//! A `credentials.file` is opened relative to the credentials directory with `openat2(2)` and
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` (see [`ProviderRules`]): `..`, an absolute path or a
//! symbolic link anywhere below the directory fails the read instead of leading out of it. The
//! file must be a regular file of at most [`MAX_SECRET_BYTES`] that other users can neither
//! read nor write (mode `o-rwx`, e.g. 0600 or 0640).

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use secrecy::{ExposeSecret, SecretString};
use vmnet_model::pool::{Credentials, ProviderRules};
use zeroize::Zeroizing;

use super::PollError;

/// The largest credentials file read, bytes.
pub const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// A provider pool's secret. `Debug` shows `Secret(..)`; the memory is zeroed on drop.
#[derive(Clone)]
pub struct Secret(SecretString);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Opens `relative` below the directory `dir` without following symbolic links or leaving it.
fn open_beneath(dir: &str, relative: &str) -> std::io::Result<std::fs::File> {
    let d: OwnedFd = nix::fcntl::open(
        dir,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    let fd = nix::fcntl::openat2(&d, relative, how)?;
    Ok(std::fs::File::from(fd))
}

/// Reads the credentials file `path` under `rules` (see the module docs).
fn read_file(path: &str, rules: &ProviderRules) -> Result<Zeroizing<String>, PollError> {
    let err = |why: String| PollError::Credentials(format!("credentials file {path}: {why}"));
    let rel = rules.relative(path).ok_or_else(|| {
        err(format!(
            "not a file in the agent's credentials directory {}",
            rules.credentials_dir()
        ))
    })?;
    let f = open_beneath(rules.credentials_dir(), rel).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::EXDEV) {
            err(format!(
                "refused: a symbolic link or a path leaving {} ({e})",
                rules.credentials_dir()
            ))
        } else {
            err(e.to_string())
        }
    })?;
    let meta = f.metadata().map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o007 != 0 {
        return Err(err(format!(
            "mode {mode:04o} lets other users read or write it; make it o-rwx (e.g. chmod 600)"
        )));
    }
    if meta.len() > MAX_SECRET_BYTES {
        return Err(err(format!("larger than {MAX_SECRET_BYTES} bytes")));
    }
    let mut raw = Zeroizing::new(Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0)));
    f.take(MAX_SECRET_BYTES)
        .read_to_end(&mut raw)
        .map_err(|e| err(e.to_string()))?;
    let text = std::str::from_utf8(&raw).map_err(|_| err("not UTF-8 text".into()))?;
    Ok(Zeroizing::new(text.to_owned()))
}

impl Secret {
    /// Reads the secret from the file or environment variable `c` names, without surrounding
    /// whitespace; a file only inside the credentials directory of `rules`.
    ///
    /// # Errors
    /// [`PollError::Credentials`] naming the file or variable (never its content): outside the
    /// directory, a symbolic link, missing, unreadable, unset or empty.
    pub fn read(c: &Credentials, rules: &ProviderRules) -> Result<Self, PollError> {
        let raw = match c {
            Credentials::File(p) => read_file(p, rules)?,
            Credentials::Env(n) => Zeroizing::new(std::env::var(n).map_err(|_| {
                PollError::Credentials(format!(
                    "credentials env {n} is not set in the agent's environment"
                ))
            })?),
        };
        let s = raw.trim();
        if s.is_empty() {
            return Err(PollError::Credentials(format!("credentials {c} are empty")));
        }
        Ok(Self(SecretString::from(s)))
    }

    /// The secret itself, for the `Authorization` header only.
    #[must_use]
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    /// A secret given directly (tests and tools).
    #[must_use]
    pub fn new(s: impl Into<String>) -> Self {
        Self(SecretString::from(s.into()))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn the_secret_never_shows() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }

    #[test]
    fn unreadable_credentials_name_their_source_only() {
        let rules = ProviderRules::default();
        let e = Secret::read(
            &Credentials::Env("VMNET_TEST_SURELY_UNSET_VAR".into()),
            &rules,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "credentials env VMNET_TEST_SURELY_UNSET_VAR is not set in the agent's environment"
        );
        assert!(e.is_auth());
        let e = Secret::read(
            &Credentials::File("/nonexistent/vmnet.token".into()),
            &rules,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("credentials file /nonexistent/vmnet.token: not a file in the agent's credentials directory"),
            "{e}"
        );
    }

    /// A file in the directory is read; a link inside it, to a file outside or inside, a path
    /// with `..` and a file outside are refused, without their content in the message.
    #[test]
    fn files_are_read_beneath_the_directory_without_links() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("creds");
        std::fs::create_dir(&dir).unwrap();
        let outside = tmp.path().join("private.key");
        std::fs::write(&outside, "TOP-SECRET-OUTSIDE\n").unwrap();
        std::fs::write(dir.join("hz.token"), " tok-1 \n").unwrap();
        std::fs::set_permissions(dir.join("hz.token"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        std::fs::write(dir.join("open.token"), "tok-2").unwrap();
        std::fs::set_permissions(
            dir.join("open.token"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        symlink(&outside, dir.join("link.token")).unwrap();
        symlink(dir.join("hz.token"), dir.join("inner.token")).unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        let rules = ProviderRules::new(dir.to_str().unwrap(), false).unwrap();
        let file = |name: &str| Credentials::File(format!("{}/{name}", dir.display()));
        assert_eq!(
            Secret::read(&file("hz.token"), &rules).unwrap().expose(),
            "tok-1"
        );
        for bad in [
            "link.token",
            "inner.token",
            "sub",
            "../private.key",
            "nope",
            "open.token",
        ] {
            let e = Secret::read(&file(bad), &rules).unwrap_err().to_string();
            assert!(!e.contains("TOP-SECRET"), "{e}");
            assert!(e.starts_with("credentials file "), "{bad}: {e}");
        }
        let e = Secret::read(&file("link.token"), &rules)
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = Secret::read(&file("open.token"), &rules)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mode 0644"), "{e}");
        let e = Secret::read(&Credentials::File(outside.display().to_string()), &rules)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a file in the agent's credentials directory"),
            "{e}"
        );
    }
}
