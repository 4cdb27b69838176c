//! An agent's rules for provider pools beyond their shape (threat model: an operator, or a
//! compromised orchestrator, must not make the agent read a file outside its credentials
//! directory or send a secret anywhere but an HTTPS endpoint).
//!
//! - `credentials.file` must name a file inside the agent's credentials directory
//!   (`vmnet serve --credentials-dir`, default [`DEFAULT_CREDENTIALS_DIR`]): an absolute path
//!   whose every component below the directory is a plain name (no `.`, `..` or empty
//!   component). The agent also opens it without following any symbolic link and without
//!   leaving the directory (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), so a link
//!   planted inside the directory does not lead out of it.
//! - `api_url` must be `https://` unless the agent runs with `--allow-plain-http-providers`
//!   (meant for a local test server).
//!
//! Pure: [`ProviderRules::check`] looks at the strings only.

use crate::ValidationError;

use super::provider::{Credentials, ProviderPool};

/// The credentials directory of an agent started without `--credentials-dir`.
pub const DEFAULT_CREDENTIALS_DIR: &str = "/etc/vmnet/credentials";

/// What an agent accepts of a provider pool's `credentials.file` and `api_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderRules {
    /// The credentials directory: absolute, without a trailing `/`.
    credentials_dir: String,
    /// Whether `http://` API URLs are allowed.
    pub plain_http: bool,
}

impl Default for ProviderRules {
    fn default() -> Self {
        Self {
            credentials_dir: DEFAULT_CREDENTIALS_DIR.to_owned(),
            plain_http: false,
        }
    }
}

impl ProviderRules {
    /// Rules with the credentials directory `dir` (`--credentials-dir`).
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the flag when `dir` is not an absolute path of plain components.
    pub fn new(dir: &str, plain_http: bool) -> Result<Self, ValidationError> {
        let trimmed = dir.trim_end_matches('/');
        let ok = dir.starts_with('/')
            && !dir.contains('\0')
            && trimmed.split('/').skip(1).all(plain_component);
        if !ok || trimmed.is_empty() {
            return Err(ValidationError::rule(format!(
                "--credentials-dir {dir:?} must be an absolute path of plain components (not /, no ., .. or empty ones)"
            )));
        }
        Ok(Self {
            credentials_dir: trimmed.to_owned(),
            plain_http,
        })
    }

    /// The credentials directory.
    #[must_use]
    pub fn credentials_dir(&self) -> &str {
        &self.credentials_dir
    }

    /// The path of `file` inside the credentials directory (`None` when it is not a file in it,
    /// see the module docs).
    #[must_use]
    pub fn relative<'a>(&self, file: &'a str) -> Option<&'a str> {
        let rest = file
            .strip_prefix(self.credentials_dir.as_str())?
            .strip_prefix('/')?;
        (!rest.is_empty() && rest.split('/').all(plain_component)).then_some(rest)
    }

    /// Checks `pool`'s `credentials.file` and `api_url` against the rules.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the pool and the field, e.g.
    /// `pool hz: credentials.file "/etc/shadow" is not a file in the agent's credentials directory /etc/vmnet/credentials (vmnet serve --credentials-dir)`,
    /// `pool hz: api_url "http://x/v1" must be https:// (the agent sends the pool's secret there; vmnet serve --allow-plain-http-providers allows http:// for a local test server)`.
    pub fn check(&self, pool: &ProviderPool) -> Result<(), ValidationError> {
        let what = format!("pool {}", pool.pool_id);
        if let Credentials::File(f) = &pool.credentials
            && self.relative(f).is_none()
        {
            return Err(ValidationError::rule(format!(
                "{what}: credentials.file {f:?} is not a file in the agent's credentials directory {} (vmnet serve --credentials-dir)",
                self.credentials_dir
            )));
        }
        let https = pool
            .api_url
            .get(..8)
            .is_some_and(|s| s.eq_ignore_ascii_case("https://"));
        if !https && !self.plain_http {
            return Err(ValidationError::rule(format!(
                "{what}: api_url {:?} must be https:// (the agent sends the pool's secret there; vmnet serve --allow-plain-http-providers allows http:// for a local test server)",
                pool.api_url
            )));
        }
        Ok(())
    }
}

/// A path component that is a name: not empty, `.` or `..`.
fn plain_component(c: &str) -> bool {
    !c.is_empty() && c != "." && c != ".."
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Provider;

    fn pool(url: &str, creds: Credentials) -> ProviderPool {
        ProviderPool {
            pool_id: "hz".into(),
            provider: Provider::HetznerCloud,
            api_url: url.into(),
            credentials: creds,
            poll_interval_secs: 30,
        }
    }

    fn file(p: &str) -> Credentials {
        Credentials::File(p.into())
    }

    #[test]
    fn credential_files_stay_in_the_directory() {
        let r = ProviderRules::default();
        let ok = |p: &str| r.check(&pool("https://x/v1", file(p)));
        assert!(ok("/etc/vmnet/credentials/hcloud.token").is_ok());
        assert!(ok("/etc/vmnet/credentials/sub/pve.token").is_ok());
        for bad in [
            "/etc/shadow",
            "/var/lib/vmnet/wireguard.key",
            "/etc/vmnet/credentials",
            "/etc/vmnet/credentials/",
            "/etc/vmnet/credentials/../../shadow",
            "/etc/vmnet/credentials/./x",
            "/etc/vmnet/credentials//x",
            "/etc/vmnet/credentialsX/x",
        ] {
            let e = ok(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "pool hz: credentials.file {bad:?} is not a file in the agent's credentials directory /etc/vmnet/credentials (vmnet serve --credentials-dir)"
                )
            );
        }
        assert!(
            r.check(&pool("https://x", Credentials::Env("T".into())))
                .is_ok()
        );
        let own = ProviderRules::new("/srv/creds/", false).unwrap();
        assert_eq!(own.credentials_dir(), "/srv/creds");
        assert_eq!(own.relative("/srv/creds/a/b"), Some("a/b"));
        for bad in ["creds", "/", "/a/../b", "/a//b", ""] {
            assert!(ProviderRules::new(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn plain_http_only_when_allowed() {
        let creds = Credentials::Env("T".into());
        let strict = ProviderRules::default();
        let e = strict
            .check(&pool("http://127.0.0.1:8080/v1", creds.clone()))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("pool hz: api_url \"http://127.0.0.1:8080/v1\" must be https://"),
            "{e}"
        );
        assert!(
            strict
                .check(&pool("https://api.hetzner.cloud/v1", creds.clone()))
                .is_ok()
        );
        let lax = ProviderRules {
            plain_http: true,
            ..ProviderRules::default()
        };
        assert!(lax.check(&pool("http://127.0.0.1:8080/v1", creds)).is_ok());
    }
}
