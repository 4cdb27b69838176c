//! A throwaway PostgreSQL cluster for tests and benchmarks: unix socket only, run as the
//! `postgres` OS user (when we are root), in a fresh temporary directory.
//!
//! # Design
//! [`PgCluster::start`] spawns a small watchdog shell (as the `postgres` user) whose stdin is a
//! pipe held by this process. The watchdog runs `initdb -A trust`, starts the server with
//! `pg_ctl start -w` (`listen_addresses=''`, `unix_socket_directories=<dir>`), prints `READY` and
//! then waits for end-of-file on its stdin. When the cluster is dropped, or when this process
//! exits for any reason (the kernel closes the pipe), the watchdog runs
//! `pg_ctl stop -m immediate` and removes the directory. So one cluster per test binary
//! ([`PgCluster::shared`], a process-wide `OnceLock`) leaves no server behind after `cargo test`.
//! Each test takes a fresh database with [`PgCluster::fresh_database_url`].
//!
//! # Limitations
//! * The server binaries are looked up under `/usr/lib/postgresql/*/bin/` (Debian package
//!   `postgresql`), the newest version first. Without them [`PgCluster::shared`] panics with a
//!   message saying so: PostgreSQL tests fail, they never skip.
//! * A watchdog killed with `SIGKILL` itself (not its parent) leaves the server running.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, Result, bail};

/// Server settings for a cluster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PgOptions {
    /// `true`: PostgreSQL's durable defaults (`fsync=on`, `synchronous_commit=on`), for
    /// benchmarks. `false`: `fsync=off`, `synchronous_commit=off`, `full_page_writes=off`, for
    /// fast tests.
    pub durable: bool,
}

/// A running throwaway cluster. Dropping it stops the server and removes its directory.
#[derive(Debug)]
pub struct PgCluster {
    dir: PathBuf,
    bin: PathBuf,
    stdin: Mutex<Option<ChildStdin>>,
    child: Mutex<Child>,
    next_db: AtomicU64,
    /// The server's `-o` options (kept for [`PgCluster::start_server`]).
    options: String,
}

/// The server options of a cluster in `dir`: unix socket only, in `dir`.
fn server_options(dir: &Path, durable: bool) -> String {
    let extra = if durable {
        ""
    } else {
        " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    };
    format!(
        "-c listen_addresses='' -c unix_socket_directories='{}' -c max_connections=400{extra}",
        dir.display()
    )
}

/// The newest `/usr/lib/postgresql/<version>/bin` that has `initdb`, `pg_ctl`, `createdb` and `psql`.
///
/// # Errors
/// When PostgreSQL's server binaries are not installed.
pub fn find_bin_dir() -> Result<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        for e in entries.flatten() {
            let bin = e.path().join("bin");
            let version = e
                .file_name()
                .to_string_lossy()
                .split('.')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if ["initdb", "pg_ctl", "createdb", "psql"]
                .iter()
                .all(|b| bin.join(b).is_file())
            {
                found.push((version, bin));
            }
        }
    }
    found.sort();
    match found.pop() {
        Some((_, bin)) => Ok(bin),
        None => bail!(
            "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin/; \
             install the Debian package `postgresql` (apt-get install -y postgresql)"
        ),
    }
}

const WATCHDOG: &str = r#"
trap '' INT TERM HUP
D="$1"; BIN="$2"; OPTS="$3"
"$BIN/initdb" -A trust -U postgres -E UTF8 --locale=C -D "$D/data" >"$D/initdb.log" 2>&1 || exit 1
"$BIN/pg_ctl" -D "$D/data" -l "$D/server.log" -w -t 60 -o "$OPTS" start >/dev/null 2>&1 || exit 1
echo READY
while read -r _; do :; done
"$BIN/pg_ctl" -D "$D/data" -m immediate stop >/dev/null 2>&1
rm -rf "$D"
"#;

impl PgCluster {
    /// Starts a cluster in a fresh directory under the system temp dir.
    ///
    /// # Errors
    /// When the binaries are missing, the `postgres` user does not exist (as root), or
    /// `initdb`/`pg_ctl` fail (their logs are in the error).
    pub fn start(opts: PgOptions) -> Result<PgCluster> {
        let bin = find_bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("vmnet-pg-")
            .tempdir()
            .context("creating a temp dir")?
            .keep();
        let mut cmd = Command::new("/bin/sh");
        crate::state::inherit_no_descriptors(&mut cmd);
        let options = server_options(&dir, opts.durable);
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("vmnet-pg-watchdog")
            .arg(&dir)
            .arg(&bin)
            .arg(&options);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .current_dir(&dir);
        if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .context("looking up the postgres user")?
                .context("no `postgres` OS user (install the Debian package `postgresql`)")?;
            nix::unistd::chown(&dir, Some(user.uid), Some(user.gid))
                .context("chown of the cluster dir")?;
            cmd.uid(user.uid.as_raw())
                .gid(user.gid.as_raw())
                .env("HOME", &dir)
                .env("USER", "postgres");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .context("chmod of the cluster dir")?;
        let mut child = cmd.spawn().context("spawning the PostgreSQL watchdog")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("watchdog stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("waiting for PostgreSQL to start")?;
        if line.trim() != "READY" {
            let _ = child.wait();
            let logs = read_logs(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            bail!("PostgreSQL did not start:\n{logs}");
        }
        Ok(PgCluster {
            dir,
            bin,
            stdin: Mutex::new(stdin),
            child: Mutex::new(child),
            next_db: AtomicU64::new(0),
            options,
        })
    }

    /// Stops the server (`pg_ctl stop -m fast`) and keeps the cluster, for outage tests: clients
    /// are disconnected and new connections refused until [`PgCluster::start_server`].
    ///
    /// # Errors
    /// When `pg_ctl` fails (its output is in the error).
    pub fn stop_server(&self) -> Result<()> {
        self.pg_ctl(&["-m", "fast", "stop"])
    }

    /// Starts the server stopped by [`PgCluster::stop_server`] again, with the same settings
    /// and socket, and waits until it accepts connections.
    ///
    /// # Errors
    /// When `pg_ctl` fails (its output is in the error).
    pub fn start_server(&self) -> Result<()> {
        let log = self.dir.join("server.log");
        let log = log.to_str().context("cluster path is not UTF-8")?;
        self.pg_ctl(&["-l", log, "-w", "-t", "60", "-o", &self.options, "start"])
    }

    /// Runs `pg_ctl -D <data> ARGS` as the cluster's owner.
    fn pg_ctl(&self, args: &[&str]) -> Result<()> {
        let mut cmd = Command::new(self.bin.join("pg_ctl"));
        crate::state::inherit_no_descriptors(&mut cmd);
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(args)
            .stdin(Stdio::null())
            .current_dir(&self.dir);
        if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .context("looking up the postgres user")?
                .context("no `postgres` OS user")?;
            cmd.uid(user.uid.as_raw())
                .gid(user.gid.as_raw())
                .env("HOME", &self.dir)
                .env("USER", "postgres");
        }
        let out = cmd.output().context("running pg_ctl")?;
        if !out.status.success() {
            bail!(
                "pg_ctl {}: {}{}",
                args.last().copied().unwrap_or_default(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// The process-wide test cluster (fast, non-durable settings), started on first use and
    /// stopped when the process exits.
    ///
    /// # Panics
    /// When the cluster cannot be started (e.g. PostgreSQL is not installed), with the reason.
    pub fn shared() -> &'static PgCluster {
        static SHARED: OnceLock<PgCluster> = OnceLock::new();
        SHARED.get_or_init(|| match PgCluster::start(PgOptions::default()) {
            Ok(c) => c,
            Err(e) => panic!("cannot start the test PostgreSQL cluster: {e:#}"),
        })
    }

    /// The socket directory (also the cluster's directory).
    #[must_use]
    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    /// The URL of database `db` as superuser `postgres` over the unix socket.
    #[must_use]
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@localhost/{db}?host={}",
            self.dir.display()
        )
    }

    /// Creates a new, empty database (`vmnet_<pid>_<n>`) and returns its URL.
    ///
    /// # Errors
    /// When `createdb` fails.
    pub fn fresh_database_url(&self) -> Result<String> {
        Ok(self.url(&self.fresh_database()?))
    }

    /// Creates a new, empty database (`vmnet_<pid>_<n>`) and returns its name.
    ///
    /// # Errors
    /// When `createdb` fails.
    pub fn fresh_database(&self) -> Result<String> {
        let n = self.next_db.fetch_add(1, Ordering::Relaxed);
        let name = format!("vmnet_{}_{n}", std::process::id());
        createdb(&self.bin, &self.dir, &name)?;
        Ok(name)
    }

    /// Runs `sql` with `psql` (unaligned, tuples only, `|` between columns, stop on error) in
    /// database `db`, and returns its standard output.
    ///
    /// # Errors
    /// When `psql` cannot run or the SQL fails (its stderr is in the error).
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let out = Command::new(self.bin.join("psql"))
            .arg("-h")
            .arg(&self.dir)
            .args([
                "-U",
                "postgres",
                "-d",
                db,
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .output()
            .context("running psql")?;
        if !out.status.success() {
            bail!("psql failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

fn createdb(bin: &Path, dir: &Path, name: &str) -> Result<()> {
    let out = Command::new(bin.join("createdb"))
        .args(["-h"])
        .arg(dir)
        .args(["-U", "postgres", name])
        .output()
        .context("running createdb")?;
    if !out.status.success() {
        bail!(
            "createdb {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A cluster that outlives the process that started it, for a sandbox that stays up after
/// `vmnet-lab up` returns (the fleet's shared store). Same settings as [`PgCluster`] (unix socket
/// only, `trust`, run as `postgres`, fast non-durable settings), but no watchdog: whoever
/// removes the sandbox stops the server by [`DetachedPg::pid`] (`SIGINT`, fast shutdown) and
/// then removes [`DetachedPg::dir`].
#[derive(Debug, Clone)]
pub struct DetachedPg {
    /// The cluster's directory (data in `data/`, socket and logs beside it).
    pub dir: PathBuf,
    /// The server's (postmaster's) pid; its command line names `dir`.
    pub pid: u32,
    bin: PathBuf,
}

impl DetachedPg {
    /// Starts a cluster in `dir`, a fresh empty directory (made accessible to the `postgres`
    /// user when we are root), and waits until it accepts connections.
    ///
    /// # Errors
    /// When the binaries are missing, `initdb` or `pg_ctl start` fail (their logs are in the
    /// error), or the pid cannot be read.
    pub fn start(dir: &Path) -> Result<DetachedPg> {
        let bin = find_bin_dir()?;
        let user = if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .context("looking up the postgres user")?
                .context("no `postgres` OS user (install the Debian package `postgresql`)")?;
            nix::unistd::chown(dir, Some(user.uid), Some(user.gid))
                .context("chown of the cluster dir")?;
            Some(user)
        } else {
            None
        };
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .context("chmod of the cluster dir")?;
        let as_postgres = |cmd: &mut Command| {
            if let Some(user) = &user {
                cmd.uid(user.uid.as_raw())
                    .gid(user.gid.as_raw())
                    .env("HOME", dir)
                    .env("USER", "postgres");
            }
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .current_dir(dir)
                // Its own process group: a Ctrl-C meant for `vmnet-lab up` does not reach it.
                .process_group(0);
        };
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "-D",
            ])
            .arg(dir.join("data"));
        as_postgres(&mut initdb);
        let log = std::fs::File::create(dir.join("initdb.log")).context("initdb.log")?;
        initdb
            .stderr(log.try_clone().context("initdb.log")?)
            .stdout(log);
        let ok = initdb.status().context("running initdb")?.success();
        if !ok {
            bail!("initdb failed:\n{}", read_logs(dir));
        }
        let mut start = Command::new(bin.join("pg_ctl"));
        crate::state::inherit_no_descriptors(&mut start)
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-l")
            .arg(dir.join("server.log"))
            .args(["-w", "-t", "60", "-o"])
            .arg(server_options(dir, false))
            .arg("start");
        as_postgres(&mut start);
        if !start.status().context("running pg_ctl start")?.success() {
            bail!("PostgreSQL did not start:\n{}", read_logs(dir));
        }
        let pidfile = dir.join("data/postmaster.pid");
        let pid = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok()))
            .with_context(|| format!("reading {}", pidfile.display()))?;
        Ok(DetachedPg {
            dir: dir.to_path_buf(),
            pid,
            bin,
        })
    }

    /// The URL of database `db` as superuser `postgres` over the unix socket.
    #[must_use]
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@localhost/{db}?host={}",
            self.dir.display()
        )
    }

    /// Creates the empty database `name`.
    ///
    /// # Errors
    /// When `createdb` fails.
    pub fn create_database(&self, name: &str) -> Result<()> {
        createdb(&self.bin, &self.dir, name)
    }
}

fn read_logs(dir: &Path) -> String {
    ["initdb.log", "server.log"]
        .iter()
        .map(|f| {
            format!(
                "--- {f}\n{}",
                std::fs::read_to_string(dir.join(f)).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if let Ok(mut stdin) = self.stdin.lock() {
            if let Some(s) = stdin.as_mut() {
                let _ = s.flush();
            }
            stdin.take();
        }
        if let Ok(mut child) = self.child.lock() {
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_starts_creates_databases_and_cleans_up() {
        let c = PgCluster::start(PgOptions::default())
            .expect("PostgreSQL must be installed for this test");
        let dir = c.socket_dir().to_path_buf();
        let url = c.fresh_database_url().unwrap();
        assert!(url.contains("host="));
        assert!(dir.join(".s.PGSQL.5432").exists(), "the unix socket exists");
        drop(c);
        assert!(!dir.exists(), "the cluster dir is removed on drop");
    }
}
