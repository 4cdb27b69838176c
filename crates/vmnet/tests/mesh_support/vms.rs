//! VMs made through a node's agent, each with a simulated guest behind its tap that serves a TCP
//! and UDP echo on its mesh address ([`PORT`]) and routes `fdaa::/16` via the host.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

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
