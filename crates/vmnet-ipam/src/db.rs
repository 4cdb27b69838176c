//! The store handle ([`Db`]), the [`Store`] trait with its two backends, and the caller-owned
//! transaction ([`Tx`]).
//!
//! Every IPAM function takes `&mut Tx`, so a placement and its lease commit or roll back together;
//! the caller ends the transaction with [`Tx::commit`] (dropping it rolls back).
//!
//! * SQLite (`sqlite://PATH`): the file (and its directory) is created if missing; WAL journal,
//!   `synchronous=FULL` (every commit is durable once `commit` returns), foreign keys on, busy
//!   timeout 10 s. Transactions start with `BEGIN IMMEDIATE`, so writers queue for the write lock
//!   up front instead of failing when a read lock would have to be upgraded.
//! * PostgreSQL (`postgres://…`, e.g. `postgres://postgres@localhost/vmnet?host=/run/postgresql` for a unix
//!   socket): READ COMMITTED transactions; row locks serialize concurrent placers.
//!
//! Migrations (`migrations/sqlite`, `migrations/postgres`, embedded) run on connect. IPAM uses
//! versions below 0100; other modules add theirs from 0100 up in both directories.

use std::future::Future;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use crate::error::BUSY;
use crate::error::{IpamError, TxError};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Postgres, Sqlite, Transaction};

/// The SQLite migrations (embedded from `migrations/sqlite`).
pub static SQLITE_MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");
/// The PostgreSQL migrations (embedded from `migrations/postgres`).
pub static POSTGRES_MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// Whether PostgreSQL failed the statement on a deadlock or a serialization conflict.
fn is_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("40P01" | "40001")))
}

/// Maps a database failure to [`IpamError::Database`]: a sentence of ours as the message, e.g.
/// `the database refused the request (SQLSTATE 23514); the details are logged`, and the
/// database's own words (which name internals: PostgreSQL's source lines, constraint and table
/// names) as the source, logged here (`warn`) and never answered to a caller. A deadlock or
/// serialization conflict is [`IpamError::Busy`], which the retry loops recognise.
pub(crate) fn db_err(e: sqlx::Error) -> IpamError {
    if is_conflict(&e) {
        tracing::debug!(error = %e, "database conflict; the transaction will be retried");
        return IpamError::Busy;
    }
    tracing::warn!(error = %e, "database request failed");
    let what = match &e {
        sqlx::Error::Database(d) => format!(
            "the database refused the request (SQLSTATE {}); the details are logged",
            d.code().as_deref().unwrap_or("unknown")
        ),
        sqlx::Error::PoolTimedOut => "no database connection became free in time; try again".into(),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => "the database is unreachable; try again".into(),
        _ => "the database request failed; the details are logged".into(),
    };
    IpamError::Database { what, source: e }
}

static RETRIED: AtomicU64 = AtomicU64::new(0);

/// How many transactions were run again after a [`BUSY`] failure since the process started.
#[must_use]
pub fn retried_transactions() -> u64 {
    RETRIED.load(Ordering::Relaxed)
}

/// The retry policy of a transaction that failed [`BUSY`]: at most [`Retry::ATTEMPTS`] attempts in
/// all, each retry after a random pause between half and all of a doubling base (2 ms, 4 ms, …,
/// capped at 128 ms; under 0.3 s in all), so transactions that deadlocked on each other do not
/// meet again in lockstep.
#[derive(Debug, Default)]
pub struct Retry {
    attempt: u32,
}

impl Retry {
    /// Attempts in all, the first included.
    pub const ATTEMPTS: u32 = 8;

    /// A fresh policy (nothing tried yet).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// After a failed attempt: when `e` is [`BUSY`] and attempts are left, waits the jittered
    /// pause and returns true (run the transaction again); else returns false at once.
    pub async fn again(&mut self, e: &impl TxError) -> bool {
        if !e.is_busy() {
            return false;
        }
        self.attempt += 1;
        if self.attempt >= Self::ATTEMPTS {
            tracing::warn!(
                attempts = self.attempt,
                "a transaction stayed busy; giving up"
            );
            return false;
        }
        RETRIED.fetch_add(1, Ordering::Relaxed);
        let base_ms = 1u64 << self.attempt.min(7);
        let pause = fastrand::u64(base_ms * 500..=base_ms * 1000);
        tokio::time::sleep(Duration::from_micros(pause)).await;
        true
    }
}

/// Runs `attempt` (which opens, runs and commits its own transaction) until it succeeds, fails
/// with anything but [`BUSY`], or the [`Retry`] policy gives up.
///
/// # Errors
/// The last attempt's error.
pub async fn retry<T, E, F, Fut>(mut attempt: F) -> Result<T, E>
where
    E: TxError,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut policy = Retry::new();
    loop {
        match attempt().await {
            Err(e) if policy.again(&e).await => {}
            other => return other,
        }
    }
}

/// Runs `$body` (an expression using `$tx: &mut Tx`) in a transaction of `$store` (a
/// [`Store`](crate::Store)), commits on `Ok` and rolls back on `Err`; a [`BUSY`] failure (of the
/// body or of the commit) runs the whole transaction again under the [`Retry`] policy. `$body` is
/// evaluated once per attempt, so it must not move out of its captures. The value is
/// `Result<T, E>` where `E` is the body's error type, a [`TxError`](crate::TxError) (an
/// [`IpamError`](crate::IpamError) or a type that holds one).
#[macro_export]
macro_rules! transaction {
    ($store:expr, $tx:ident => $body:expr) => {{
        let mut policy = $crate::Retry::new();
        loop {
            let begun = {
                use $crate::Store as _;
                $store.begin().await
            };
            let result = match begun {
                Err(e) => Err(::core::convert::From::from(e)),
                Ok(mut owned) => {
                    let $tx = &mut owned;
                    match $body {
                        Ok(v) => owned
                            .commit()
                            .await
                            .map(|()| v)
                            .map_err(::core::convert::From::from),
                        Err(e) => {
                            let _ = owned.rollback().await;
                            Err(e)
                        }
                    }
                }
            };
            match result {
                Err(e) if policy.again(&e).await => {}
                other => break other,
            }
        }
    }};
}

/// Which database a store or transaction talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// SQLite, one file, WAL.
    Sqlite,
    /// PostgreSQL.
    Postgres,
}

/// A transaction owned by the caller. Commit with [`Tx::commit`]; dropping it rolls back.
///
/// The variants are public so other modules can run their own SQL in the same transaction
/// (`&mut **t` is the connection).
#[derive(Debug)]
pub enum Tx {
    /// A SQLite transaction (`BEGIN IMMEDIATE`).
    Sqlite(Transaction<'static, Sqlite>),
    /// A PostgreSQL transaction (READ COMMITTED).
    Postgres(Transaction<'static, Postgres>),
}

impl Tx {
    /// Commits.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the database refuses the commit.
    pub async fn commit(self) -> Result<(), IpamError> {
        match self {
            Tx::Sqlite(t) => t.commit().await.map_err(db_err),
            Tx::Postgres(t) => t.commit().await.map_err(db_err),
        }
    }

    /// Rolls back.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the database connection fails.
    pub async fn rollback(self) -> Result<(), IpamError> {
        match self {
            Tx::Sqlite(t) => t.rollback().await.map_err(db_err),
            Tx::Postgres(t) => t.rollback().await.map_err(db_err),
        }
    }

    /// The backend of this transaction.
    #[must_use]
    pub fn backend(&self) -> Backend {
        match self {
            Tx::Sqlite(_) => Backend::Sqlite,
            Tx::Postgres(_) => Backend::Postgres,
        }
    }
}

/// A store: something that opens IPAM transactions. Both backends behave identically.
pub trait Store: Send + Sync {
    /// Opens a transaction.
    ///
    /// # Errors
    /// `UNAVAILABLE` when no connection can be had.
    fn begin(&self) -> impl Future<Output = Result<Tx, IpamError>> + Send;
    /// Which backend this is.
    fn backend(&self) -> Backend;
}

/// The SQLite backend.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// The connection pool (WAL, foreign keys, busy timeout).
    pub pool: SqlitePool,
}

/// The PostgreSQL backend.
#[derive(Debug, Clone)]
pub struct PgStore {
    /// The connection pool.
    pub pool: PgPool,
}

impl Store for SqliteStore {
    async fn begin(&self) -> Result<Tx, IpamError> {
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map(Tx::Sqlite)
            .map_err(db_err)
    }
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }
}

impl Store for PgStore {
    async fn begin(&self) -> Result<Tx, IpamError> {
        self.pool.begin().await.map(Tx::Postgres).map_err(db_err)
    }
    fn backend(&self) -> Backend {
        Backend::Postgres
    }
}

/// The store handle: either backend, chosen by URL.
#[derive(Debug, Clone)]
pub enum Db {
    /// SQLite.
    Sqlite(SqliteStore),
    /// PostgreSQL.
    Postgres(PgStore),
}

impl Store for Db {
    async fn begin(&self) -> Result<Tx, IpamError> {
        match self {
            Db::Sqlite(s) => s.begin().await,
            Db::Postgres(s) => s.begin().await,
        }
    }
    fn backend(&self) -> Backend {
        match self {
            Db::Sqlite(_) => Backend::Sqlite,
            Db::Postgres(_) => Backend::Postgres,
        }
    }
}

/// How long a PostgreSQL request waits for a pooled connection by default.
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

impl Db {
    /// Connects to `sqlite://PATH` or `postgres://…` (also `postgresql://`) with default pool
    /// sizes (SQLite 4, PostgreSQL 10) and runs the migrations.
    ///
    /// # Errors
    /// `INVALID_INPUT` for an unknown scheme or a malformed URL; `UNAVAILABLE` when the database
    /// cannot be opened or migrated.
    pub async fn connect(url: &str) -> Result<Db, IpamError> {
        Self::connect_with(url, None).await
    }

    /// Like [`Db::connect`] with at most `max_connections` pooled connections.
    ///
    /// # Errors
    /// As [`Db::connect`].
    pub async fn connect_with(url: &str, max_connections: Option<u32>) -> Result<Db, IpamError> {
        Self::connect_timeout(url, max_connections, DEFAULT_ACQUIRE_TIMEOUT).await
    }

    /// Like [`Db::connect_with`], with PostgreSQL's pool waiting at most `acquire_timeout` for a
    /// connection (sqlx keeps retrying a refused connection until then): a store that is down
    /// fails each request after that time instead of the default 30 s. SQLite ignores it.
    ///
    /// # Errors
    /// As [`Db::connect`].
    pub async fn connect_timeout(
        url: &str,
        max_connections: Option<u32>,
        acquire_timeout: Duration,
    ) -> Result<Db, IpamError> {
        if url.starts_with("sqlite:") {
            let opts = SqliteConnectOptions::from_str(url).map_err(|e| IpamError::Url {
                url: url.to_owned(),
                source: e,
            })?;
            if let Some(dir) = opts
                .get_filename()
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
            {
                create_dir(dir)?;
            }
            // Two processes opening a fresh database at once would both find the migrations
            // missing (SQLite has no migration lock): the second failed on "table pools already
            // exists". A lock file beside the database makes them take turns. It is not the
            // database file itself: closing any descriptor of that file would drop the POSIX
            // locks SQLite holds on it in this process.
            let file = opts.get_filename().to_path_buf();
            let migrate_lock = if file.as_os_str().is_empty() || file == Path::new(":memory:") {
                None
            } else {
                // Off the runtime's threads: the wait may be for a task of this very process.
                let locked = tokio::task::spawn_blocking(move || lock_beside(&file)).await;
                Some(locked.map_err(|e| IpamError::Io {
                    what: "waiting for the migration lock".into(),
                    source: std::io::Error::other(e),
                })??)
            };
            let opts = opts
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .foreign_keys(true)
                // Checkpoint every ~32 MiB of WAL instead of SQLite's 4 MiB: fewer checkpoint
                // stalls in a writer's commit (lease p99 2.1 ms -> 0.8 ms in `bench ipam`).
                .pragma("wal_autocheckpoint", "8000")
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .max_connections(max_connections.unwrap_or(4))
                .connect_with(opts)
                .await
                .map_err(IpamError::Connect)?;
            SQLITE_MIGRATOR
                .run(&pool)
                .await
                .map_err(IpamError::Migrate)?;
            drop(migrate_lock);
            Ok(Db::Sqlite(SqliteStore { pool }))
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let opts = PgConnectOptions::from_str(url).map_err(|e| IpamError::Url {
                url: url.to_owned(),
                source: e,
            })?;
            let pool = PgPoolOptions::new()
                .max_connections(max_connections.unwrap_or(10))
                .acquire_timeout(acquire_timeout)
                .connect_with(opts)
                .await
                .map_err(IpamError::Connect)?;
            POSTGRES_MIGRATOR
                .run(&pool)
                .await
                .map_err(IpamError::Migrate)?;
            Ok(Db::Postgres(PgStore { pool }))
        } else {
            Err(IpamError::UnknownScheme {
                url: url.to_owned(),
            })
        }
    }

    /// Closes every pooled connection.
    pub async fn close(&self) {
        match self {
            Db::Sqlite(s) => s.pool.close().await,
            Db::Postgres(s) => s.pool.close().await,
        }
    }
}

/// Takes an exclusive lock on `<db>.migrate-lock` (made if missing), waiting for another
/// process that holds it; released when the returned file is dropped.
fn lock_beside(db: &Path) -> Result<std::fs::File, IpamError> {
    let mut name = db.as_os_str().to_owned();
    name.push(".migrate-lock");
    let path = std::path::PathBuf::from(name);
    let io = |source| IpamError::Io {
        what: format!("cannot lock {}", path.display()),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    f.lock().map_err(io)?;
    Ok(f)
}

fn create_dir(dir: &Path) -> Result<(), IpamError> {
    std::fs::create_dir_all(dir).map_err(|source| IpamError::Io {
        what: format!("cannot create database directory {}", dir.display()),
        source,
    })
}

/// Runs the same expression against whichever connection `tx` holds; `$c` is bound to the
/// `&mut Transaction` of that backend. For SQL that is identical on both databases. Both arms
/// must have the same type, so end the body with a backend-neutral value (decode rows into
/// tuples with `query_as`/`query_scalar`, or end an `execute` with `.rows_affected()`).
macro_rules! on_tx {
    ($tx:expr, $c:ident => $body:expr) => {
        match $tx {
            $crate::db::Tx::Sqlite($c) => $body,
            $crate::db::Tx::Postgres($c) => $body,
        }
    };
}
pub(crate) use on_tx;

/// Opens savepoint `name` inside `tx` (names are fixed identifiers of this crate).
pub(crate) async fn savepoint(tx: &mut Tx, name: &'static str) -> Result<(), IpamError> {
    exec_static(tx, sqlx::AssertSqlSafe(format!("SAVEPOINT {name}"))).await
}

/// Releases (keeps the work of) savepoint `name`.
pub(crate) async fn release_savepoint(tx: &mut Tx, name: &'static str) -> Result<(), IpamError> {
    exec_static(tx, sqlx::AssertSqlSafe(format!("RELEASE SAVEPOINT {name}"))).await
}

/// Undoes everything since savepoint `name` and releases it; the transaction stays usable.
pub(crate) async fn rollback_to(tx: &mut Tx, name: &'static str) -> Result<(), IpamError> {
    exec_static(
        tx,
        sqlx::AssertSqlSafe(format!("ROLLBACK TO SAVEPOINT {name}")),
    )
    .await?;
    release_savepoint(tx, name).await
}

async fn exec_static(tx: &mut Tx, sql: sqlx::AssertSqlSafe<String>) -> Result<(), IpamError> {
    on_tx!(tx, t => sqlx::raw_sql(sql).execute(&mut **t).await.map_err(db_err)?.rows_affected());
    Ok(())
}

/// Runs `$body` (an async expression using `$tx`) inside savepoint `$name`: on `Err` everything it
/// wrote is undone, so the caller's transaction is as it was before the call.
macro_rules! atomically {
    ($tx:ident, $name:literal, $body:expr) => {{
        $crate::db::savepoint($tx, $name).await?;
        match $body {
            Ok(v) => {
                $crate::db::release_savepoint($tx, $name).await?;
                Ok(v)
            }
            Err(e) => {
                $crate::db::rollback_to($tx, $name).await?;
                Err(e)
            }
        }
    }};
}
pub(crate) use atomically;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn database_errors_keep_their_words_out_of_the_message() {
        let pool = SqlitePoolOptions::new()
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (n INTEGER CHECK (n > 0))")
            .execute(&pool)
            .await
            .unwrap();
        let e = sqlx::query("INSERT INTO t (n) VALUES (-1)")
            .execute(&pool)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("CHECK constraint failed"), "{e}");
        let mapped = db_err(e);
        assert!(matches!(mapped, IpamError::Database { .. }), "{mapped:?}");
        assert_eq!(
            mapped.to_string(),
            "the database refused the request (SQLSTATE 275); the details are logged"
        );
        assert!(!mapped.is_busy());
        let mapped = db_err(sqlx::Error::PoolTimedOut);
        assert_eq!(
            mapped.to_string(),
            "no database connection became free in time; try again"
        );
        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset by peer at x.c:12",
        );
        assert_eq!(
            db_err(sqlx::Error::Io(io)).to_string(),
            "the database is unreachable; try again"
        );
    }

    #[tokio::test]
    async fn retry_gives_up_on_other_errors_at_once_and_on_busy_after_the_attempts() {
        let mut calls = 0;
        let r: Result<(), IpamError> = retry(|| {
            calls += 1;
            async { Err(IpamError::Conflict("no".into())) }
        })
        .await;
        assert!(matches!(r, Err(IpamError::Conflict(_))));
        assert_eq!(calls, 1);
        let mut calls = 0;
        let started = std::time::Instant::now();
        let r: Result<(), IpamError> = retry(|| {
            calls += 1;
            async { Err(IpamError::Busy) }
        })
        .await;
        assert!(r.unwrap_err().is_busy());
        assert_eq!(calls, Retry::ATTEMPTS);
        assert!(
            started.elapsed() < Duration::from_millis(400),
            "bounded pauses"
        );
        let mut calls = 0;
        let r = retry(|| {
            calls += 1;
            let n = calls;
            async move { if n < 3 { Err(IpamError::Busy) } else { Ok(n) } }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
    }
}
