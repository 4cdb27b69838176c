//! The unprivileged worker on a real kernel (root required; a throwaway sandbox): the process
//! that serves the metadata service runs as the worker user with no capability, `no_new_privs`
//! and a seccomp filter (`/proc/<pid>/status`); a forbidden system call made inside it (injected
//! with ptrace, as code running in it would make it) kills it with `SIGSYS` and the agent starts
//! it again; `kill -9` of it costs a guest polling every 250 ms at most one failed poll, and
//! the guest's session token stays valid.

mod agent_support;

use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agent_support::{options, start, vm};
use vmnet_agent::api::types::{AgentStatus, VmView};
use vmnet_testkit::guest::{GuestConfig, SimGuest};
use vmnet_testkit::{Sandbox, netns, require_root};

/// `Key:` of `/proc/<pid>/status`.
fn status_field(pid: u32, key: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

async fn worker_status(client: &vmnet_agent::client::Client) -> vmnet_agent::status::WorkerStatus {
    let st: AgentStatus = client.get("/v1/status").await.expect("status");
    st.worker.expect("the worker runs")
}

/// Waits for a running worker other than `not` and returns its pid.
async fn next_worker(client: &vmnet_agent::client::Client, not: u32) -> u32 {
    let t = Instant::now();
    loop {
        if let Some(p) = worker_status(client).await.pid.filter(|p| *p != not) {
            return p;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no new worker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_worker_runs_without_root_capabilities_or_free_system_calls() {
    require_root();
    let sb = Sandbox::new("wk").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let agent = start(&options(&sb, &dir, 60)).await;
    let client = agent.client().clone();
    let w = worker_status(&client).await;
    let pid = w.pid.expect("a pid");
    let user = nix::unistd::User::from_name(vmnet_agent::worker::DEFAULT_USER)
        .unwrap()
        .expect("the worker user exists");
    assert_eq!(
        (w.user.as_str(), w.uid),
        ("vmnet-worker", user.uid.as_raw())
    );
    assert_ne!(w.uid, 0);
    assert_eq!(status_field(pid, "PPid"), agent.pid().to_string());
    let uid = status_field(pid, "Uid");
    let want = format!("{0}\t{0}\t{0}\t{0}", w.uid);
    assert_eq!(uid, want, "real, effective, saved, fs uid");
    let gid = status_field(pid, "Gid");
    assert!(!gid.split_whitespace().any(|g| g == "0"), "gid {gid}");
    assert_eq!(status_field(pid, "Groups"), "", "no supplementary groups");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, cap), "0000000000000000", "{cap}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2", "a seccomp filter");
    // Its descriptors: stdin, stdout, stderr, its socket to the agent, sockets; no file.
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let target = std::fs::read_link(fd.path()).unwrap();
        let t = target.to_string_lossy();
        let n: u32 = fd.file_name().to_str().unwrap().parse().unwrap();
        assert!(
            n <= 2 || t.starts_with("socket:") || t.starts_with("anon_inode:"),
            "fd {n} -> {t}"
        );
    }
    // The store is not readable by other users, the worker's included.
    let db_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(dir.join("vmnet.db"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(db_mode & 0o007, 0, "store mode {db_mode:o}");
    // A VM's listener: served by the worker, whose fd table now holds it.
    let v: VmView = client.put("/v1/vms/wk1", &vm("wk", 1)).await.unwrap();
    assert_eq!(worker_status(&client).await.vms, 1);
    drop(v);
    drop(agent);
    drop(sb);
}

/// Makes the stopped thread `pid` execute system call `nr` (no arguments) at the `syscall`
/// instruction it is stopped after, then lets it run (x86_64).
#[cfg(target_arch = "x86_64")]
fn inject_syscall(pid: u32, nr: i64) {
    use nix::sys::ptrace;
    use nix::sys::wait::{WaitPidFlag, waitpid};
    use nix::unistd::Pid;
    let p = Pid::from_raw(i32::try_from(pid).unwrap());
    ptrace::seize(p, ptrace::Options::empty()).expect("seize the worker");
    ptrace::interrupt(p).expect("interrupt");
    waitpid(p, Some(WaitPidFlag::__WALL)).expect("wait for the stop");
    let mut regs = ptrace::getregs(p).expect("registers");
    // Idle in epoll_wait: the instruction before rip is `syscall` (0f 05).
    let at = regs.rip - 2;
    let word = ptrace::read(p, at as ptrace::AddressType).expect("read text");
    assert_eq!(word & 0xffff, 0x050f, "stopped after a syscall instruction");
    regs.rip = at;
    regs.rax = u64::try_from(nr).unwrap();
    regs.orig_rax = u64::MAX;
    regs.rdi = 0;
    ptrace::setregs(p, regs).expect("set registers");
    ptrace::detach(p, None).expect("detach");
}

#[cfg(target_arch = "x86_64")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and traces a process (scripts/test.sh runs it)"]
async fn a_forbidden_system_call_kills_the_worker_and_the_agent_restarts_it() {
    require_root();
    let sb = Sandbox::new("wf").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let agent = start(&options(&sb, &dir, 60)).await;
    let client = agent.client().clone();
    let v: VmView = client.put("/v1/vms/wf1", &vm("wf", 1)).await.unwrap();
    let guest = SimGuest::attach(
        &sb,
        "g",
        &v.status.netns,
        &v.status.tap,
        &GuestConfig::default(),
    )
    .expect("guest");
    let r = vmnet_testkit::mmds::get_with_token(
        guest.netns(),
        "/latest/meta-data/instance-id",
        Duration::from_secs(3),
    )
    .unwrap();
    assert_eq!(r.body, "wf1");
    let w = worker_status(&client).await;
    let pid = w.pid.unwrap();
    // unshare(0) changes nothing where it is allowed; the worker's filter forbids it.
    inject_syscall(pid, libc::SYS_unshare);
    let new = next_worker(&client, pid).await;
    let w = worker_status(&client).await;
    let exit = w.last_exit.clone().unwrap_or_default();
    assert!(
        exit.contains("SIGSYS"),
        "killed by its seccomp filter: {exit}"
    );
    assert_eq!(w.starts, 2);
    assert_ne!(new, pid);
    assert!(agent.log_text().contains("metadata worker ended"), "logged");
    // The new worker serves the VM again.
    let t = Instant::now();
    loop {
        let r = vmnet_testkit::mmds::get_with_token(
            guest.netns(),
            "/latest/meta-data/instance-id",
            Duration::from_secs(1),
        );
        if r.as_ref().is_ok_and(|r| r.body == "wf1") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status_field(new, "Seccomp"), "2");
    drop(guest);
    drop(agent);
    drop(sb);
}

/// A guest polling as `vmnet-guest` does: one keep-alive connection, a session token fetched
/// once, one `GET /latest/meta-data` every 250 ms; a request that fails on a reused connection
/// is tried once more on a new one. Counts the polls that failed.
struct Poller {
    conn: Option<TcpStream>,
    token: String,
}

fn connect() -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(
        &SocketAddrV4::new(std::net::Ipv4Addr::new(169, 254, 169, 254), 80).into(),
        Duration::from_millis(1000),
    )?;
    s.set_read_timeout(Some(Duration::from_millis(1000)))?;
    Ok(s)
}

/// One request and its answer (status, body) on `s`.
fn exchange(s: &mut TcpStream, raw: &str) -> std::io::Result<(u16, String)> {
    s.write_all(raw.as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(i) = text.find("\r\n\r\n") {
            let len: usize = text[..i]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if buf.len() >= i + 4 + len {
                let status = text[9..12].parse().unwrap_or(0);
                return Ok((status, text[i + 4..i + 4 + len].to_owned()));
            }
        }
    }
}

impl Poller {
    fn request(&mut self, raw: &str) -> std::io::Result<(u16, String)> {
        let reused = self.conn.is_some();
        let mut s = match self.conn.take() {
            Some(s) => s,
            None => connect()?,
        };
        match exchange(&mut s, raw) {
            Ok(r) => {
                self.conn = Some(s);
                Ok(r)
            }
            Err(_) if reused => {
                let mut s = connect()?;
                let r = exchange(&mut s, raw)?;
                self.conn = Some(s);
                Ok(r)
            }
            Err(e) => Err(e),
        }
    }

    fn poll(&mut self) -> bool {
        let raw = format!(
            "GET /latest/meta-data HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token: {}\r\nAccept: application/json\r\n\r\n",
            self.token
        );
        matches!(self.request(&raw), Ok((200, _)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn kill_9_of_the_worker_costs_a_polling_guest_at_most_one_poll() {
    require_root();
    let sb = Sandbox::new("wp").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let agent = start(&options(&sb, &dir, 60)).await;
    let client = agent.client().clone();
    let v: VmView = client.put("/v1/vms/wp1", &vm("wp", 1)).await.unwrap();
    let guest = SimGuest::attach(
        &sb,
        "g",
        &v.status.netns,
        &v.status.tap,
        &GuestConfig::default(),
    )
    .expect("guest");
    let stop = Arc::new(AtomicBool::new(false));
    let ns = guest.netns().to_owned();
    let polling = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            netns::enter(&ns).expect("enter the guest");
            let mut p = Poller {
                conn: None,
                token: String::new(),
            };
            let (st, token) = p
                .request("PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token-ttl-seconds: 21600\r\nContent-Length: 0\r\n\r\n")
                .expect("token");
            assert_eq!(st, 200);
            p.token = token.trim().to_owned();
            let (mut ok, mut failed) = (0u32, Vec::new());
            let start = Instant::now();
            let mut due = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if p.poll() {
                    ok += 1;
                } else {
                    failed.push(start.elapsed());
                }
                due += Duration::from_millis(250);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = worker_status(&client).await.pid.unwrap();
    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let new = next_worker(&client, pid).await;
    eprintln!(
        "a new worker (pid {new}) {:?} after the kill",
        killed_at.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = polling.join().unwrap();
    eprintln!("{ok} polls answered, {} failed at {failed:?}", failed.len());
    assert!(failed.len() <= 1, "at most one failed poll: {failed:?}");
    assert!(ok >= 15, "{ok} polls answered");
    let w = worker_status(&client).await;
    let exit = w.last_exit.unwrap_or_default();
    assert!(
        exit.contains("SIGKILL"),
        "the last exit is the kill: {exit}"
    );
    // The new worker reported its requests (every 2 s) and kept running: started once more.
    assert_eq!(w.starts, 2, "one start after the kill, none after: {exit}");
    let (_, body) = client
        .send_raw(hyper::Method::GET, "/metrics", None)
        .await
        .expect("metrics");
    let text = String::from_utf8_lossy(&body);
    let answered: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("vmnet_metadata_requests_total{status=\"200\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_default();
    assert!(
        answered >= 5.0,
        "the workers' counts reached the metrics: {text}"
    );
    drop(guest);
    drop(agent);
    drop(sb);
}
