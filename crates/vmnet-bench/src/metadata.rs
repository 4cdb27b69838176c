//! `vmnet-lab bench metadata`: the metadata service under N VMs polling it.
//!
//! # What is measured
//! - N throwaway network namespaces (`vmbmd<pid>-<i>`), each with `lo` up and 169.254.169.254/32
//!   on it, and in each a listener made as the agent makes it
//!   ([`vmnet_agent::metadata::bind_in`]) and served by the real unprivileged worker process
//!   the agent runs ([`vmnet_agent::worker::Worker`]: `vmnet serve --worker-serve` as
//!   `--worker-user`, no capabilities, under its seccomp filter, the listeners handed over with
//!   `SCM_RIGHTS`), so the worker process's CPU time is the serving side's.
//! - Clients: worker threads, each owning a share of the VMs, behaving as `vmnet-guest` does
//!   ([`CLIENT_BEHAVIOUR`], printed with the results): per VM one HTTP/1.1 keep-alive
//!   connection made inside that VM's namespace, a v2 token fetched once and reused, then one
//!   `GET /latest/meta-data` (`Accept: application/json`: the whole folder) every
//!   `interval_ms`: N × 1000 / interval requests a second, over each namespace's loopback (the
//!   guest's tap and relay are not part of the server's cost).
//! - Reported: the worker's CPU as % of one core (its `utime + stime`, all its threads, over
//!   the measured window: the serving side only, not the clients'), request latency p50/p99
//!   (write to last byte, seen by the clients), requests, errors, reconnects (a kept
//!   connection closed by the service, e.g. at the end of its lifetime) and the worker's RSS
//!   with the N listeners served and at the end of the window (the namespaces' kernel memory is
//!   not in it).
//!
//! Goals (issue 15): < 10 % of a core and p99 < 5 ms at 1,000 VMs polling every 250 ms.

use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use vmnet_agent::metadata::bind_in;
use vmnet_agent::worker::{Worker, WorkerSettings, WorkerUser};
use vmnet_model::Error;
use vmnet_model::vm::metadata::MetadataVersion;
use vmnet_plan::ns::metadata::{METADATA_IPV4, METADATA_PORT};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct MetadataBenchArgs {
    /// VMs (namespaces with a listener each).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=5000))]
    pub vms: u32,
    /// Milliseconds between one VM's requests.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..=10000))]
    pub interval_ms: u64,
    /// Seconds measured.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub secs: u64,
    /// Client threads.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub clients: u32,
    /// The worker's user (as `vmnet serve --worker-user`); made with `useradd --system` when it
    /// is the default and does not exist.
    #[arg(long, default_value = vmnet_agent::worker::DEFAULT_USER)]
    pub worker_user: String,
}

/// The goals: % of a core, p99 ms.
pub const GOALS: (f64, f64) = (10.0, 5.0);

/// Deletes the bench's namespaces on drop.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = vmnet_kernel::netns::delete(n);
        }
    }
}

fn unavailable(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::unavailable(format!("bench metadata: {what}: {e}"))
}

fn rss_kib(pid: u32) -> u64 {
    crate::procstat::proc_usage(pid).map_or(0, |u| u.rss_kib)
}

/// Process `pid`'s CPU time so far: `utime + stime` of `/proc/<pid>/stat`, all its threads
/// (clock ticks, user and system time; softirq work the kernel does in its context, such as
/// loopback delivery of its replies, is in it).
fn process_cpu(pid: u32) -> Duration {
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The fields after the command name's closing parenthesis: utime and stime are
            // the 14th and 15th of the line, the 12th and 13th after it.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or_default();
    // SAFETY: sysconf only reads a configuration value.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .unwrap_or(100)
        .max(1);
    Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / hz)
}

/// What the clients do, printed with the results.
pub const CLIENT_BEHAVIOUR: &str = "clients behave as vmnet-guest: one HTTP/1.1 keep-alive \
connection per VM (a new one only when the service closed it; a request failing on a reused \
connection is retried once on a new one), a v2 token fetched once and reused, one \
GET /latest/meta-data with Accept: application/json per poll";

/// One VM's client: its kept connection and the GET carrying its token.
struct Guest {
    conn: Option<TcpStream>,
    get: Vec<u8>,
}

fn connect() -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(
        &SocketAddrV4::new(METADATA_IPV4, METADATA_PORT).into(),
        Duration::from_secs(2),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Reads one response (headers, then `Content-Length` bytes of body) and returns its body;
/// `Err` when the service closed the connection or answered other than 200.
fn read_response(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 2048];
    let (head_end, len) = loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed by the service",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (i + 4, len);
        }
    };
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("body cut short"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    if !buf.starts_with(b"HTTP/1.1 200") {
        return Err(std::io::Error::other(
            String::from_utf8_lossy(&buf).into_owned(),
        ));
    }
    Ok(buf.split_off(head_end))
}

impl Guest {
    /// One request on the kept connection (a new one, in the calling thread's current
    /// namespace, when there is none); retried once on a new connection when a reused one
    /// fails.
    fn exchange(&mut self, raw: &[u8], reconnects: &mut u64) -> std::io::Result<Vec<u8>> {
        let reused = self.conn.is_some();
        let mut s = match self.conn.take() {
            Some(s) => s,
            None => connect()?,
        };
        match s.write_all(raw).and_then(|()| read_response(&mut s)) {
            Ok(b) => {
                self.conn = Some(s);
                Ok(b)
            }
            Err(_) if reused => {
                *reconnects += 1;
                let mut s = connect()?;
                s.write_all(raw)?;
                let b = read_response(&mut s)?;
                self.conn = Some(s);
                Ok(b)
            }
            Err(e) => Err(e),
        }
    }
}

/// The token request of a simulated guest (vmnet-guest's TTL).
const TOKEN_REQUEST: &[u8] = b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token-ttl-seconds: 21600\r\n\r\n";

/// A guest's poll with `token`.
fn get_request(token: &[u8]) -> Vec<u8> {
    format!(
        "GET /latest/meta-data HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token: {}\r\nAccept: application/json\r\n\r\n",
        String::from_utf8_lossy(token).trim()
    )
    .into_bytes()
}

/// Connects to the metadata service of the calling thread's current namespace as
/// `vmnet-guest` does (a token, then one poll) and returns the kept connection (`timeout` per
/// read).
///
/// # Errors
/// A failed connection, or an answer other than 200.
pub(crate) fn open_guest(timeout: Duration) -> std::io::Result<TcpStream> {
    let mut g = Guest {
        conn: None,
        get: Vec::new(),
    };
    let mut reconnects = 0;
    let token = g.exchange(TOKEN_REQUEST, &mut reconnects)?;
    g.exchange(&get_request(&token), &mut reconnects)?;
    let c = g
        .conn
        .ok_or_else(|| std::io::Error::other("no connection kept"))?;
    c.set_read_timeout(Some(timeout))?;
    Ok(c)
}

struct ClientOut {
    latencies: Vec<Duration>,
    errors: u64,
    reconnects: u64,
}

/// One client thread: a token per VM, then a GET per VM every `every` until `stop`.
fn client(
    files: &[std::fs::File],
    every: Duration,
    start: Instant,
    measure_from: Instant,
    stop: &AtomicBool,
) -> ClientOut {
    let mut out = ClientOut {
        latencies: Vec::new(),
        errors: 0,
        reconnects: 0,
    };
    let mut guests: Vec<Option<Guest>> = Vec::with_capacity(files.len());
    for f in files {
        if setns(f.as_fd(), CloneFlags::CLONE_NEWNET).is_err() {
            out.errors += 1;
            guests.push(None);
            continue;
        }
        let mut g = Guest {
            conn: None,
            get: Vec::new(),
        };
        let token = g.exchange(TOKEN_REQUEST, &mut out.reconnects).ok();
        guests.push(token.map(|t| {
            g.get = get_request(&t);
            g
        }));
    }
    // Spread the VMs' first requests over one interval, as guests started at random would.
    let n = u32::try_from(files.len()).unwrap_or(u32::MAX).max(1);
    let mut due: Vec<Instant> = (0..n).map(|i| start + every * i / n).collect();
    while !stop.load(Ordering::Relaxed) {
        let Some((i, at)) = due.iter().copied().enumerate().min_by_key(|(_, t)| *t) else {
            break;
        };
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        due[i] = at + every;
        let Some(g) = &mut guests[i] else {
            continue;
        };
        let t0 = Instant::now();
        // Enter the VM's namespace first: a new connection is made in the thread's current one
        // (a kept connection stays in the namespace it was made in).
        let ok = setns(files[i].as_fd(), CloneFlags::CLONE_NEWNET).is_ok() && {
            let req = std::mem::take(&mut g.get);
            let r = g.exchange(&req, &mut out.reconnects);
            g.get = req;
            r.is_ok()
        };
        if t0 >= measure_from {
            if ok {
                out.latencies.push(t0.elapsed());
            } else {
                out.errors += 1;
            }
        }
    }
    out
}

fn pct(v: &[Duration], p: usize) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v[(v.len() * p / 100).min(v.len() - 1)]
}

/// Runs the bench and prints its table.
///
/// # Errors
/// `UNAVAILABLE` when the namespaces or listeners cannot be set up.
pub async fn run(a: MetadataBenchArgs) -> Result<(), Error> {
    let pid = std::process::id();
    let mut spaces = Namespaces(Vec::new());
    eprintln!("creating {} namespaces …", a.vms);
    for i in 0..a.vms {
        let name = format!("vmbmd{pid}-{i}");
        vmnet_kernel::netns::create(&name).map_err(|e| unavailable("netns")(e.to_string()))?;
        spaces.0.push(name.clone());
        let h = vmnet_kernel::netns::netlink_in(&name)
            .map_err(|e| unavailable("netlink")(e.to_string()))?;
        h.link()
            .set(rtnetlink::LinkUnspec::new_with_index(1).up().build())
            .execute()
            .await
            .map_err(|e| unavailable("lo up")(e.to_string()))?;
        h.address()
            .add(1, std::net::IpAddr::V4(METADATA_IPV4), 32)
            .execute()
            .await
            .map_err(|e| unavailable("address")(e.to_string()))?;
    }
    // The serving side: the worker process, as the agent runs it.
    vmnet_sandbox::worker_user::ensure(&a.worker_user).map_err(unavailable("worker user"))?;
    let user = WorkerUser::lookup(&a.worker_user).map_err(unavailable("worker user"))?;
    // The product's `vmnet` binary (beside `vmnet-lab`, or `--vmnet`), as the agent runs it.
    let exe = vmnet_sandbox::exe::vmnet()?;
    let worker = Worker::start(WorkerSettings {
        command: vmnet_agent::worker::command(exe),
        user: user.clone(),
        http: vmnet_agent::provider::http::HttpSettings::default(),
    })
    .await?;
    let pid = worker
        .pid()
        .ok_or_else(|| unavailable("worker")("no pid".into()))?;
    let rss_before = rss_kib(pid);
    for n in &spaces.0 {
        let (l, _) = bind_in(n).map_err(unavailable("listeners"))?;
        let doc = serde_json::json!({"latest": {"meta-data": {"instance-id": n, "mesh-ipv6": "fdaa::1", "host-routes": "0.0.0.0/0\n::/0"}}});
        worker.listen(n, l.into(), MetadataVersion::V2, doc);
    }
    // Until the worker took every listener (its table is the agent's; wait for its first
    // answers instead: the clients' token requests below wait in the queues meanwhile).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_added = rss_kib(pid).saturating_sub(rss_before);
    let every = Duration::from_millis(a.interval_ms);
    let start = Instant::now();
    // One interval of warm-up (tokens, first requests), then the measured window.
    let measure_from = start + every * 2;
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for k in 0..a.clients {
        let files: Vec<std::fs::File> = spaces
            .0
            .iter()
            .enumerate()
            .filter(|(i, _)| u32::try_from(*i).unwrap_or(0) % a.clients == k)
            .filter_map(|(_, n)| vmnet_kernel::netns::open(n).ok())
            .collect();
        let stop = Arc::clone(&stop);
        handles.push(std::thread::spawn(move || {
            client(&files, every, start, measure_from, &stop)
        }));
    }
    tokio::time::sleep_until((measure_from).into()).await;
    let cpu0 = process_cpu(pid);
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.secs)).await;
    let cpu1 = process_cpu(pid);
    let rss_end = rss_kib(pid);
    let window = w0.elapsed();
    let still = worker.pid() == Some(pid);
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    let mut errors = 0;
    let mut reconnects = 0;
    for h in handles {
        if let Ok(o) = h.join() {
            lat.extend(o.latencies);
            errors += o.errors;
            reconnects += o.reconnects;
        }
    }
    drop(worker);
    drop(spaces);
    lat.sort();
    let cpu_pct = (cpu1.saturating_sub(cpu0)).as_secs_f64() / window.as_secs_f64() * 100.0;
    let rate = lat.len() as f64 / window.as_secs_f64();
    let (p50, p99) = (pct(&lat, 50), pct(&lat, 99));
    let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1000.0);
    let rows = vec![
        vec!["vms".into(), a.vms.to_string(), String::new()],
        vec!["requests/s".into(), format!("{rate:.0}"), String::new()],
        vec!["errors".into(), errors.to_string(), "0".into()],
        vec!["reconnects".into(), reconnects.to_string(), String::new()],
        vec![
            format!(
                "worker CPU (utime+stime, pid {pid}, user {} uid {}), % of a core",
                user.name, user.uid
            ),
            format!("{cpu_pct:.1}"),
            format!("< {}", GOALS.0),
        ],
        vec![
            "worker restarts during the run".into(),
            if still { "0" } else { "≥ 1" }.into(),
            "0".into(),
        ],
        vec!["latency p50, ms".into(), ms(p50), String::new()],
        vec!["latency p99, ms".into(), ms(p99), format!("< {}", GOALS.1)],
        vec![
            format!("worker RSS added by {} listeners, KiB", a.vms),
            rss_added.to_string(),
            String::new(),
        ],
        vec![
            "worker RSS added, with every connection open (end of window), KiB".into(),
            rss_end.saturating_sub(rss_before).to_string(),
            String::new(),
        ],
    ];
    print!(
        "{}",
        vmnet_agent::table::render(&["METRIC", "VALUE", "GOAL"], &rows)
    );
    println!("{CLIENT_BEHAVIOUR}");
    Ok(())
}
