//! `vmnet bench metadata`: the metadata service under N VMs polling it.
//!
//! # What is measured
//! - N throwaway network namespaces (`vmbmd<pid>-<i>`), each with `lo` up and 169.254.169.254/32
//!   on it, and in each a real listener of the agent's service code
//!   ([`vmnet_agent::metadata::bind_in`] and [`vmnet_agent::metadata::serve`]: the same socket,
//!   HTTP stack, token check and rate limit the agent serves), all on one dedicated tokio
//!   (current-thread) runtime thread, so that thread's CPU time is the serving side's.
//! - Clients: worker threads, each owning a share of the VMs. For every VM they fetch a v2 token
//!   once, then `GET /latest/meta-data/mesh-ipv6` with it every `interval_ms` (a new connection
//!   per request, `Connection: close`, as `vmnet-guest` does), from a socket created inside that
//!   VM's namespace: N × 1000 / interval requests a second, over each namespace's loopback (the
//!   guest's tap and relay are not part of the server's cost).
//! - Reported: the serving thread's CPU as % of one core (its `schedstat` run time over the
//!   measured window), request latency p50/p99 (connect to close, seen by the clients),
//!   requests, errors and the process RSS added by the N listeners (VmRSS after binding them
//!   minus before; the namespaces' kernel memory is not in it).
//!
//! Goals (issue 15): < 10 % of a core and p99 < 5 ms at 1,000 VMs polling every 250 ms.

use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use vmnet_agent::metadata::{VmMeta, bind_in, serve};
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

fn rss_kib() -> u64 {
    crate::procstat::proc_usage(std::process::id()).map_or(0, |u| u.rss_kib)
}

/// The calling thread's CPU time so far (`/proc/thread-self/schedstat`: nanoseconds on a CPU).
fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// One request from the calling thread's current namespace; returns the body.
fn exchange(raw: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(
        &SocketAddrV4::new(METADATA_IPV4, METADATA_PORT).into(),
        Duration::from_secs(2),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(raw)?;
    let mut buf = Vec::with_capacity(512);
    s.read_to_end(&mut buf)?;
    if !buf.starts_with(b"HTTP/1.1 200") {
        return Err(std::io::Error::other(
            String::from_utf8_lossy(&buf).into_owned(),
        ));
    }
    Ok(buf)
}

fn body(resp: &[u8]) -> String {
    let t = String::from_utf8_lossy(resp);
    t.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

struct ClientOut {
    latencies: Vec<Duration>,
    errors: u64,
}

/// One client thread: tokens for its VMs, then a GET per VM every `every` until `stop`.
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
    };
    let token_req = b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\nX-metadata-token-ttl-seconds: 3600\r\nContent-Length: 0\r\n\r\n";
    let mut gets = Vec::with_capacity(files.len());
    for f in files {
        if setns(f.as_fd(), CloneFlags::CLONE_NEWNET).is_err() {
            out.errors += 1;
            gets.push(None);
            continue;
        }
        gets.push(exchange(token_req).ok().map(|r| {
            format!(
                "GET /latest/meta-data/mesh-ipv6 HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\nX-metadata-token: {}\r\n\r\n",
                body(&r).trim()
            )
            .into_bytes()
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
        let Some(req) = &gets[i] else {
            continue;
        };
        let t0 = Instant::now();
        let ok = setns(files[i].as_fd(), CloneFlags::CLONE_NEWNET).is_ok() && exchange(req).is_ok();
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
    // The serving side: its own thread and runtime.
    let names = spaces.0.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<u64, String>>();
    let (cpu_tx, cpu_rx) = std::sync::mpsc::channel::<Duration>();
    let (mark_tx, mark_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready_tx.send(Err(e.to_string()));
                return;
            }
        };
        rt.block_on(async move {
            let before = rss_kib();
            let mut tasks = Vec::new();
            for n in &names {
                match bind_in(n) {
                    Ok((l, _)) => {
                        let doc = serde_json::json!({"latest": {"meta-data": {"instance-id": n, "mesh-ipv6": "fdaa::1", "host-routes": "0.0.0.0/0\n::/0"}}});
                        tasks.push(serve(l, VmMeta::new(doc, MetadataVersion::V2)));
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                }
            }
            tokio::task::yield_now().await;
            let _ = ready_tx.send(Ok(rss_kib().saturating_sub(before)));
            // Mark the window's start and end with this thread's CPU time.
            let mut mark_rx = mark_rx;
            while mark_rx.recv().await.is_some() {
                let _ = cpu_tx.send(thread_cpu());
            }
            for t in tasks {
                t.abort();
            }
        });
    });
    let rss_added = ready_rx
        .recv()
        .map_err(|e| unavailable("server")(e.to_string()))?
        .map_err(unavailable("listeners"))?;
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
    let _ = mark_tx.send(());
    let cpu0 = cpu_rx
        .recv()
        .map_err(|e| unavailable("cpu")(e.to_string()))?;
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.secs)).await;
    let _ = mark_tx.send(());
    let cpu1 = cpu_rx
        .recv()
        .map_err(|e| unavailable("cpu")(e.to_string()))?;
    let window = w0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    let mut errors = 0;
    for h in handles {
        if let Ok(o) = h.join() {
            lat.extend(o.latencies);
            errors += o.errors;
        }
    }
    drop(mark_tx);
    let _ = server.join();
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
        vec![
            "serving CPU, % of a core".into(),
            format!("{cpu_pct:.1}"),
            format!("< {}", GOALS.0),
        ],
        vec!["latency p50, ms".into(), ms(p50), String::new()],
        vec!["latency p99, ms".into(), ms(p99), format!("< {}", GOALS.1)],
        vec![
            format!("RSS added by {} listeners, KiB", a.vms),
            rss_added.to_string(),
            String::new(),
        ],
    ];
    print!(
        "{}",
        vmnet_agent::table::render(&["METRIC", "VALUE", "GOAL"], &rows)
    );
    Ok(())
}
