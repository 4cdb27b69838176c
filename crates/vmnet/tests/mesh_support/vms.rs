//! VMs made through a node's agent, each with a simulated guest behind its tap that serves a TCP
//! and UDP echo on its mesh address ([`PORT`]) and routes `fdaa::/16` via the host.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;
use vmnet_agent::status::VmView;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::{netns, traffic};

use super::Node;

/// The echo port of every guest.
pub const PORT: u16 = 7000;
/// How long one echo check waits.
const T: Duration = Duration::from_secs(2);

/// A VM's guest: its mesh address, the simulated guest, the echo it serves.
pub struct Vm {
    /// The VM's mesh address.
    pub mesh: Ipv6Addr,
    /// The guest behind the VM's tap.
    pub guest: SimGuest,
    _echo: EchoService,
}

impl Vm {
    /// A VM's guest made elsewhere (its echo service running).
    pub fn new(mesh: Ipv6Addr, guest: SimGuest, echo: EchoService) -> Self {
        Self {
            mesh,
            guest,
            _echo: echo,
        }
    }

    /// The guest's echo service (what it saw).
    pub fn echo(&self) -> &EchoService {
        &self._echo
    }
}

/// `PUT /v1/vms/{id}` on `n`: a namespace-mode VM with a mesh address and a tenant.
pub async fn put(n: &Node, id: &str, uid: u32, tenant: u32, mesh: Ipv6Addr) -> VmView {
    let body = json!({"id": id, "user_id": uid, "tenant": tenant, "mesh_ipv6": mesh.to_string()});
    n.client()
        .put(&format!("/v1/vms/{id}"), &body)
        .await
        .unwrap_or_else(|e| panic!("put {id}: {e}\n{}", n.logs()))
}

/// A simulated guest in `<prefix>x-g<name>` behind the tap of `v`, serving the echo.
pub fn guest(n: &Node, v: &VmView, name: &str, mesh: Ipv6Addr) -> Vm {
    let ns = format!("{}x-g{name}", n.host.prefix);
    netns::create(&ns).expect("guest netns");
    let cfg = GuestConfig {
        mesh_ipv6: Some(mesh),
        routes_v6: vec![GuestRoute6 {
            destination: "fdaa::/16".into(),
            via: Some(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1)),
        }],
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach_in(&ns, &v.status.netns, &v.status.tap, &cfg).expect("guest");
    let echo = EchoService::start(&ns, &[SocketAddr::new(IpAddr::V6(mesh), PORT)]).expect("echo");
    Vm {
        mesh,
        guest,
        _echo: echo,
    }
}

/// [`put`] then [`guest`].
pub async fn vm(n: &Node, id: &str, uid: u32, tenant: u32, mesh: Ipv6Addr) -> Vm {
    let v = put(n, id, uid, tenant, mesh).await;
    guest(n, &v, id, mesh)
}

/// Whether `from`'s guest gets its TCP echo from `to`'s mesh address.
pub fn tcp(from: &Vm, to: &Vm) -> bool {
    traffic::tcp_echo(
        from.guest.netns(),
        SocketAddr::new(IpAddr::V6(to.mesh), PORT),
        T,
    )
    .is_ok()
}

/// A TCP stream from one guest to another's mesh address: 512-byte round trips every 20 ms,
/// each waiting at most 5 s for its echo.
pub struct Stream {
    stop: Arc<AtomicBool>,
    client: JoinHandle<Result<(u64, Duration), String>>,
    _server: JoinHandle<()>,
}

impl Stream {
    /// Starts the stream from `from` to `to` on `port` (an echo server in `to`'s guest).
    pub fn start(from: &Vm, to: &Vm, port: u16) -> Self {
        let at = SocketAddr::new(IpAddr::V6(to.mesh), port);
        let listener = netns::run_in(to.guest.netns(), || TcpListener::bind(at))
            .expect("netns")
            .expect("listen");
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let mut client = netns::run_in(from.guest.netns(), || TcpStream::connect_timeout(&at, T))
            .expect("netns")
            .expect("connect");
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let client = std::thread::spawn(move || -> Result<(u64, Duration), String> {
            let (mut worst, mut n) = (Duration::ZERO, 0u64);
            let msg = [7u8; 512];
            let mut back = [0u8; 512];
            while !stop2.load(Ordering::Relaxed) {
                let t = Instant::now();
                client.write_all(&msg).map_err(|e| format!("write: {e}"))?;
                client
                    .read_exact(&mut back)
                    .map_err(|e| format!("read: {e}"))?;
                worst = worst.max(t.elapsed());
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok((n, worst))
        });
        Self {
            stop,
            client,
            _server: server,
        }
    }

    /// Stops the stream; its round trips and the slowest one, or why it broke.
    pub fn finish(self) -> Result<(u64, Duration), String> {
        self.stop.store(true, Ordering::Relaxed);
        self.client.join().expect("stream thread")
    }
}
