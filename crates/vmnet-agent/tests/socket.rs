//! The agent over a real unix socket (no root): binding (mode 0660 from the moment the socket
//! appears at its path, stale socket replaced, a live one never stolen), the client, and a
//! declarative host-spec apply (the repository's `examples/host.json` plus pools, hosts and
//! instances), with the fake driver.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use common::Harness;
use vmnet_agent::api::types::{AgentStatus, VmState, VmView};
use vmnet_agent::apply::apply_host_spec;
use vmnet_agent::client::Client;
use vmnet_agent::hostspec::HostSpec;
use vmnet_agent::server::{self, ServerError};
use vmnet_model::ErrorCode;

async fn serve(h: &Harness, sock: &std::path::Path) -> tokio::task::JoinHandle<()> {
    let unix = server::bind_unix(sock, server::Access::default())
        .await
        .unwrap();
    let router = vmnet_agent::api::router(Arc::clone(&h.agent));
    tokio::spawn(async move {
        server::serve(router, unix, std::future::pending())
            .await
            .unwrap();
    })
}

#[tokio::test]
async fn binding_rules() {
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("run/vmnet.sock");
    // A stale socket (nobody listening) is replaced; the parent directory is created.
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let l = server::bind_unix(&sock, server::Access::default())
        .await
        .unwrap();
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    // Nothing is left of the private bind directory.
    let left: Vec<_> = std::fs::read_dir(sock.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("vmnet.sock")]);
    // A live socket is never stolen.
    let e = server::bind_unix(&sock, server::Access::default())
        .await
        .unwrap_err();
    assert!(matches!(e, ServerError::InUse(_)), "{e}");
    drop(l);
    // A path that is not a socket is refused.
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let e = server::bind_unix(&file, server::Access::default())
        .await
        .unwrap_err();
    assert!(matches!(e, ServerError::InUse(_)), "{e}");
}

/// The socket never appears at its path with the mode the umask gives a new file: it is made in
/// a private directory and renamed into place already 0660 (inotify sees a move, never a
/// create, of its name), even under a umask of 0.
#[tokio::test]
async fn the_socket_appears_with_its_final_mode() {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("vmnet.sock");
    let ino = Inotify::init(InitFlags::IN_NONBLOCK).unwrap();
    ino.add_watch(
        tmp.path(),
        AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO,
    )
    .unwrap();
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    let l = server::bind_unix(&sock, server::Access::default()).await;
    nix::sys::stat::umask(old);
    let l = l.unwrap();
    let events = ino.read_events().unwrap();
    let named: Vec<AddWatchFlags> = events
        .iter()
        .filter(|e| e.name.as_deref() == Some(std::ffi::OsStr::new("vmnet.sock")))
        .map(|e| e.mask)
        .collect();
    assert_eq!(named, vec![AddWatchFlags::IN_MOVED_TO], "{events:?}");
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    drop(l);
}

#[tokio::test]
async fn client_and_host_spec_over_the_socket() {
    let h = Harness::new().await;
    let sock = h.dir.join("vmnet.sock");
    let task = serve(&h, &sock).await;
    let client = Client::new(&sock);

    let st: AgentStatus = client.get("/v1/status").await.unwrap();
    assert_eq!(st.vms.desired, 0);
    let e = client.get::<VmView>("/v1/vms/nope").await.unwrap_err();
    assert_eq!(
        (e.code, e.message.as_str()),
        (ErrorCode::NotFound, "vm nope not found")
    );
    let e = client.get::<VmView>("/v1/whatever").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);

    // The repository's example host spec, plus IPAM entries.
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/host.json"
    ))
    .unwrap();
    let mut spec = HostSpec::parse("examples/host.json", &example).unwrap();
    let extra = HostSpec::parse(
        "extra",
        r#"{"pools": [{"pool_id": "p1", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1"}],
            "hosts": [{"host_id": "h1", "vcpus": 8, "memory_mib": 8192}],
            "instances": [{"instance_id": "i1", "pool_id": "p1", "vcpus": 1, "memory_mib": 512}]}"#,
    )
    .unwrap();
    spec.pools = extra.pools;
    spec.hosts = extra.hosts;
    spec.instances = extra.instances;
    let report = apply_host_spec(&client, &spec, false).await.unwrap();
    let results: Vec<(String, String)> = report
        .items
        .iter()
        .map(|i| (i.kind.clone(), i.result.clone()))
        .collect();
    assert_eq!(
        results[0],
        ("pool".into(), "set 10.0.0.0/29 (10.0.0.2-10.0.0.6)".into())
    );
    assert_eq!(
        results[2],
        ("instance".into(), "created (10.0.0.2 on h1)".into())
    );
    assert!(
        results[3..]
            .iter()
            .all(|(k, r)| k == "vm" && r == "created (applied)"),
        "{results:?}"
    );
    let vms: Vec<VmView> = client.get("/v1/vms").await.unwrap();
    assert_eq!(vms.len(), spec.vms.len());
    assert!(vms.iter().all(|v| v.status.state == VmState::Applied));

    // Applying the same file again changes nothing.
    let again = apply_host_spec(&client, &spec, false).await.unwrap();
    assert!(
        again
            .items
            .iter()
            .skip(1)
            .all(|i| i.result.starts_with("unchanged") || i.kind == "host"),
        "{again:?}"
    );
    let applies = h.driver.kernel().applies.len();
    assert_eq!(applies, spec.vms.len(), "unchanged VMs are not put again");

    // --prune deletes only the VMs the file does not list.
    let listed = spec.vms.len();
    spec.vms.truncate(1);
    let pruned = apply_host_spec(&client, &spec, true).await.unwrap();
    assert_eq!(
        pruned
            .items
            .iter()
            .filter(|i| i.result.starts_with("deleted"))
            .count(),
        listed - 1
    );
    let vms: Vec<VmView> = client.get("/v1/vms").await.unwrap();
    assert_eq!(vms.len(), 1);
    let inst: vmnet_model::pool::Instance = client.get("/v1/instances/i1").await.unwrap();
    assert_eq!(
        inst.address.unwrap().to_string(),
        "10.0.0.2",
        "prune never touches instances"
    );

    // An error mid-apply names the entry.
    let bad = HostSpec::parse(
        "bad",
        r#"{"instances": [{"instance_id": "i2", "pool_id": "nope", "vcpus": 1, "memory_mib": 1}]}"#,
    )
    .unwrap();
    let e = apply_host_spec(&client, &bad, false).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(e.message.starts_with("apply instance i2: "), "{e}");
    task.abort();
}

/// Sends `request` on a new connection to `sock` and reads the answer until the agent closes
/// the connection (or 5 s passed).
async fn raw_exchange(sock: &std::path::Path, request: Vec<u8>) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
    // The server may answer (and close) before it has read everything.
    let _ = s.write_all(&request).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

/// The request heads the HTTP layer (hyper) refuses before the API sees them are answered with
/// a bare status and the connection closed, as api.md documents: a request target over 65,534
/// bytes is 414, more than 100 header fields 431. A long target under the limit reaches the API
/// and is answered with the error body.
#[tokio::test]
async fn heads_the_http_layer_refuses_are_answered_bare_as_documented() {
    let h = Harness::new().await;
    let sock = h.dir.join("vmnet.sock");
    let task = serve(&h, &sock).await;
    let get = |target: &str, headers: usize| {
        let mut r = format!("GET {target} HTTP/1.1\r\nHost: vmnet\r\nConnection: close\r\n");
        for i in 0..headers {
            r.push_str(&format!("X-H{i}: x\r\n"));
        }
        r.push_str("\r\n");
        r.into_bytes()
    };
    let under = format!("/v1/{}", "a".repeat(60_000));
    let answer = raw_exchange(&sock, get(&under, 0)).await;
    assert!(
        answer.starts_with("HTTP/1.1 404") && answer.contains(r#""code":"NOT_FOUND""#),
        "{}",
        &answer[..answer.len().min(300)]
    );
    for (request, status) in [
        (get(&format!("/v1/{}", "a".repeat(70_000)), 0), "414"),
        (get("/v1/status", 101), "431"),
    ] {
        let answer = raw_exchange(&sock, request).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} "))
                && answer
                    .to_ascii_lowercase()
                    .contains("content-length: 0\r\n")
                && answer.ends_with("\r\n\r\n"),
            "{answer}"
        );
    }
    task.abort();
}

/// A client that sends its whole request and then shuts down its sending side (as `nc -N`
/// does) still gets the request carried out and its answer.
#[tokio::test]
async fn a_request_followed_by_a_half_close_is_answered() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let h = Harness::new().await;
    let sock = h.dir.join("vmnet.sock");
    let task = serve(&h, &sock).await;
    let body = r#"{"id":"half","user_id":9,"tenant":0}"#;
    let request = format!(
        "PUT /v1/vms/half HTTP/1.1\r\nHost: vmnet\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("answered within 5 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&got);
    assert!(answer.starts_with("HTTP/1.1 20"), "{answer}");
    let (status, _) = h.call(axum::http::Method::GET, "/v1/vms/half", None).await;
    assert_eq!(status, axum::http::StatusCode::OK, "the VM is stored");
    task.abort();
}

/// Clients that open connections and send nothing cannot use up the agent: past the cap a new
/// connection is closed at accept, an idle one is closed once its header time is up, and then
/// the agent answers again. (Small bounds here; the agent's are `server::MAX_CONNECTIONS` and
/// `server::HEADER_TIMEOUT`.)
#[tokio::test]
async fn idle_connections_are_capped_and_timed_out() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncReadExt as _;
    let h = Harness::new().await;
    let sock = h.dir.join("vmnet.sock");
    let unix = server::bind_unix(&sock, server::Access::default())
        .await
        .unwrap();
    let router = vmnet_agent::api::router(Arc::clone(&h.agent));
    let limits = server::Limits {
        max_connections: 3,
        header_timeout: Duration::from_millis(400),
    };
    let task = tokio::spawn(async move {
        server::serve_with(router, unix, std::future::pending(), limits)
            .await
            .unwrap();
    });
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(tokio::net::UnixStream::connect(&sock).await.unwrap());
    }
    // Let the agent accept the three before the fourth comes.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = Instant::now();
    let mut fourth = tokio::net::UnixStream::connect(&sock).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_millis(300), fourth.read(&mut buf))
        .await
        .expect("the fourth connection is closed at accept, before any header timeout")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed unanswered");
    // The idle ones are closed when their header time is up.
    for mut s in idle {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .expect("an idle connection is closed")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    // The slots are free again: a real request is answered.
    let answer = raw_exchange(
        &sock,
        b"GET /v1/status HTTP/1.1\r\nHost: vmnet\r\nConnection: close\r\n\r\n".to_vec(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    task.abort();
}

/// A client waits for an agent that accepted its connection and never answers (stopped, hung)
/// only as long as its bound, then says so naming the request.
#[tokio::test]
async fn a_silent_agent_is_waited_for_only_as_long_as_the_bound() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("silent.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            kept.push(s);
        }
    });
    let client = Client::new(&sock).with_timeout(Duration::from_millis(300));
    let t0 = Instant::now();
    let e = client.get::<AgentStatus>("/v1/status").await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(
        e.message.contains("no answer to /v1/status within 300ms"),
        "{e}"
    );
    let e = client
        .events_lines("follow=true", |_| true)
        .await
        .unwrap_err();
    assert!(e.message.contains("no answer to /v1/events"), "{e}");
    // The blocking exchange of the one-call commands has the same bound and the same words.
    let blocking = client.clone();
    let t0 = Instant::now();
    let e = tokio::task::spawn_blocking(move || blocking.get_blocking::<AgentStatus>("/v1/status"))
        .await
        .unwrap()
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(
        e.message.contains("no answer to /v1/status within 300ms"),
        "{e}"
    );
    held.abort();
}

/// The blocking exchange against an agent that reads the request and hangs up without a word,
/// and one that answers with a body cut short: each is `UNAVAILABLE` naming the request.
#[tokio::test]
async fn a_blocking_request_to_an_agent_that_hangs_up_is_an_error() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("rude.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let rude = tokio::spawn(async move {
        // First connection: read a little, hang up. Second: a head promising more than comes.
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; 16];
        let _ = s.read(&mut buf).await;
        drop(s);
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf).await;
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"state\"")
            .await;
        drop(s);
    });
    let client = Client::new(&sock);
    let big = vec![b' '; 1 << 20];
    let c = client.clone();
    let e = tokio::task::spawn_blocking(move || {
        c.put_blocking::<serde_json::Value>("/v1/vms/x", &String::from_utf8(big).unwrap())
    })
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
    assert!(e.message.contains("/v1/vms/x"), "{e}");
    let c = client.clone();
    let e = tokio::task::spawn_blocking(move || c.get_blocking::<AgentStatus>("/v1/status"))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
    assert!(e.message.contains("reading the reply failed"), "{e}");
    rude.await.unwrap();
}

/// An agent that accepts nothing (stopped) and whose queue of connections not yet accepted is
/// full: the blocking exchange fails at once naming the full queue, as the async one does,
/// instead of a `connect` that waits without bound.
#[test]
fn a_full_connection_queue_is_refused_at_once() {
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("full.sock");
    let _listener = UnixListener::bind(&sock).unwrap();
    // Fill the queue with connections nobody accepts.
    let mut queued = Vec::new();
    loop {
        let fd = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_NONBLOCK,
            None,
        )
        .unwrap();
        let addr = nix::sys::socket::UnixAddr::new(&sock).unwrap();
        match nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => queued.push(UnixStream::from(fd)),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(queued.len() < 100_000, "the queue never filled");
    }
    let t0 = Instant::now();
    let e = Client::new(&sock)
        .get_blocking::<AgentStatus>("/v1/status")
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(
        e.message.contains("queue of new connections is full"),
        "{e}"
    );
}

/// A peer posing as the agent that answers with more than the client reads (64 MiB): the
/// blocking and the async exchange and the event stream's error answer refuse it naming the
/// limit, and the event stream refuses a line over 1 MiB, without holding it all.
#[tokio::test]
async fn a_reply_over_the_limit_is_refused() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("big.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let big = tokio::spawn(async move {
        for i in 0..4 {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let n = vmnet_agent::client::REPLY_LIMIT_BYTES + (1 << 20);
            let status = if i == 3 { "404 Not Found" } else { "200 OK" };
            let head = format!("HTTP/1.1 {status}\r\ncontent-length: {n}\r\n\r\n");
            let _ = s.write_all(head.as_bytes()).await;
            let chunk = vec![b' '; 1 << 20];
            for _ in 0..=n >> 20 {
                if s.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        }
    });
    let client = Client::new(&sock);
    let c = client.clone();
    let e = tokio::task::spawn_blocking(move || c.get_blocking::<AgentStatus>("/v1/status"))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
    assert!(
        e.message
            .contains("the reply is larger than 67108864 bytes"),
        "{e}"
    );
    let e = client.get::<AgentStatus>("/v1/status").await.unwrap_err();
    assert!(
        e.message
            .contains("the reply is larger than 67108864 bytes"),
        "{e}"
    );
    // The event stream: a line without an end, then an error answer over the limit.
    let e = client
        .events_lines("follow=true", |_| true)
        .await
        .unwrap_err();
    assert!(e.message.contains("longer than 1048576 bytes"), "{e}");
    let e = client
        .events_lines("follow=true", |_| true)
        .await
        .unwrap_err();
    assert!(
        e.message
            .contains("the reply is larger than 67108864 bytes"),
        "{e}"
    );
    big.abort();
}
