//! Namespace mode with real guests: each VM's guest boots under qemu in the VM's namespace, on
//! the tap vmnet made there, with the image's fixed guest configuration (172.16.0.2/30 via
//! 172.16.0.1, MTU 1380, by systemd-networkd) and `vmnet-guest` applying the mesh address and the
//! host routes from the metadata service. The connectivity checks the simulated guests run
//! ([`crate::ns_job::checks::plan_checks`]) run here from inside the real guests, over the
//! command channel, with a small Python echo service and client in each guest that speak the
//! sandbox's echo protocol ([`crate::echo`]):
//!
//! | check | expected |
//! |---|---|
//! | `booted: guest address on eth0` | `172.16.0.2/30` (networkd, from the image) |
//! | `booted: vmnet-guest put the mesh address on eth0` | `<mesh>/128` (from the metadata service) |
//! | `host routes from metadata` | the IPv6 routes via `fe80::1`: the mesh range and each IPv6 route via `host` |
//! | every check of [`plan_checks`] but `gateway …` | as there (`from <ip>`, `no reach`, `syn mss 1340` …) |
//!
//! A `gateway …` check needs the gateway guest to route a probe address on: real guests are not
//! set up for that, so it is left out here (the simulated guests run it).

use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use super::{Channel, Vm};
use crate::ns_job::checks::{CheckResult, GuestInfo, NO_REACH, Probe, plan_checks};

/// The kernel command line words of a namespace-mode guest: no cloud-init (nothing to seed), and
/// the condition `vmnet-guest.service` starts on.
pub const CMDLINE: &str = "cloud-init=disabled vmnet.mode=ns";

/// The qemu arguments of a guest's one NIC: `tap` (opened by qemu in the VM's namespace) and the
/// guest MAC the image's networkd configuration matches.
#[must_use]
pub fn nic_args(tap: &str, mac: &str) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("tap,id=net0,ifname={tap},script=no,downscript=no"),
        "-device".into(),
        format!("virtio-net-pci,netdev=net0,mac={mac}"),
    ]
}

/// The echo service the checks talk to in each guest: TCP and UDP port 7 on every address, the
/// protocol of [`crate::echo`] (without the SYN's MSS, which only the fake internet's service
/// reports).
const ECHO_PY: &str = r#"import socket, threading
def peer(a):
    ip = a[0]
    return "%s:%d" % (ip[7:], a[1]) if ip.startswith("::ffff:") else "[%s]:%d" % (ip, a[1])
def serve(c, a):
    c.settimeout(5)
    data = b""
    try:
        while len(data) < 4096 and not data.endswith(b"\n"):
            b = c.recv(1024)
            if not b:
                break
            data += b
        c.sendall(("peer=%s syn_mss=none\n" % peer(a)).encode() + data)
    except OSError:
        pass
    c.close()
def sock(kind):
    s = socket.socket(socket.AF_INET6, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", 7))
    return s
def udp():
    s = sock(socket.SOCK_DGRAM)
    while True:
        d, a = s.recvfrom(65535)
        s.sendto(("peer=%s\n" % peer(a)).encode() + d, a)
threading.Thread(target=udp, daemon=True).start()
t = sock(socket.SOCK_STREAM)
t.listen(64)
while True:
    c, a = t.accept()
    threading.Thread(target=serve, args=(c, a), daemon=True).start()
"#;

/// The client: `probe.py tcp|udp|mss HOST PORT` prints what a check sees (`from <ip>`,
/// `syn mss <n>`, `no mss option` or `no reach`).
const PROBE_PY: &str = r#"import socket, sys
kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
try:
    if kind == "udp":
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.settimeout(2)
        s.sendto(b"vmnet\n", (host, port))
        d = s.recv(65535)
    else:
        s = socket.create_connection((host, port), timeout=2)
        s.sendall(b"vmnet\n")
        d = b""
        while True:
            b = s.recv(4096)
            if not b:
                break
            d += b
    f = dict(w.split("=", 1) for w in d.split(b"\n", 1)[0].decode().split())
    if kind == "mss":
        m = f.get("syn_mss", "none")
        print("no mss option" if m == "none" else "syn mss " + m)
    else:
        print("from " + f["peer"].rsplit(":", 1)[0].strip("[]"))
except (OSError, KeyError, ValueError):
    print("no reach")
"#;

/// A real guest of a namespace-mode sandbox.
pub struct NsGuest {
    /// The VM id.
    pub id: String,
    /// The running VM.
    pub vm: Vm,
    /// Its command channel, once it answered.
    pub ch: Option<Channel>,
    /// The mesh address vmnet-guest must configure.
    pub mesh: Option<Ipv6Addr>,
    /// The IPv6 destinations the VM routes via `host` (its host routes in the metadata).
    pub host_routes6: Vec<String>,
    /// Seconds from qemu's start to the network being ready (the mesh address on `eth0`, or the
    /// guest address without a mesh address).
    pub ready_secs: Option<f64>,
}

impl NsGuest {
    /// Runs `script` in the guest: its output, trimmed, or `error: …`.
    pub fn sh(&mut self, script: &str, timeout: Duration) -> String {
        match self.ch.as_mut() {
            None => "error: no command channel".into(),
            Some(ch) => match ch.run(script, timeout) {
                Ok(r) => r.output.trim().to_owned(),
                Err(e) => format!("error: {e}"),
            },
        }
    }

    /// The global addresses of `family` (`-4`, `-6`) on `eth0`, `addr/len` joined by spaces, once
    /// they are exactly `want` or `timeout` passed (polled in the guest every 200 ms).
    pub fn wait_addresses(&mut self, want: &str, family: &str, timeout: Duration) -> String {
        let tries = timeout.as_millis() / 200 + 1;
        let list =
            format!("ip {family} -o addr show dev eth0 scope global | awk '{{print $4}}' | xargs");
        let script = format!(
            "for i in $(seq {tries}); do [ \"$({list})\" = '{want}' ] && break; sleep 0.2; done\n{list}"
        );
        self.sh(&script, timeout + Duration::from_secs(5))
    }

    /// `present` once a route to `prefix` is on `eth0` (`absent` once none is, with `present`
    /// false), or what is there when `timeout` passed (polled in the guest every 200 ms).
    pub fn wait_route(&mut self, prefix: &str, present: bool, timeout: Duration) -> String {
        let tries = timeout.as_millis() / 200 + 1;
        let fam = if prefix.contains(':') { "-6" } else { "-4" };
        let test = if present { "-n" } else { "-z" };
        let show = format!("ip {fam} route show {prefix} dev eth0");
        let script = format!(
            "for i in $(seq {tries}); do [ {test} \"$({show})\" ] && break; sleep 0.2; done\n             r=$({show}); [ -n \"$r\" ] && echo present || echo absent"
        );
        self.sh(&script, timeout + Duration::from_secs(5))
    }

    /// The IPv6 routes via `fe80::1` on `eth0`, destinations sorted and joined by `, `.
    pub fn routes_via_host(&mut self) -> String {
        let out = self.sh(
            "ip -6 route show dev eth0 | awk '$2 == \"via\" && $3 == \"fe80::1\" {print $1}' | LC_ALL=C sort",
            Duration::from_secs(10),
        );
        out.lines().collect::<Vec<_>>().join(", ")
    }
}

/// What [`NsGuest::routes_via_host`] should list: the mesh range and the VM's IPv6 routes via
/// `host` (`::/0` shown as `default`, as `ip` does), sorted.
#[must_use]
pub fn expected_routes(host_routes6: &[String]) -> String {
    let mut v: Vec<String> = std::iter::once(vmnet_model::vm::MESH_RANGE.to_string())
        .chain(host_routes6.iter().map(|d| {
            if d == "::/0" {
                "default".to_owned()
            } else {
                d.clone()
            }
        }))
        .collect();
    v.sort();
    v.dedup();
    v.join(", ")
}

/// Waits for every guest (booted in parallel) within `timeout` of its qemu's start: its command
/// channel, the guest address, the mesh address vmnet-guest applies and its host routes; then
/// starts the echo service in it. Three checks per guest.
pub fn wait_ready(guests: &mut [NsGuest], timeout: Duration) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for g in guests.iter_mut() {
        let started = g.vm.started;
        let left = || timeout.saturating_sub(started.elapsed());
        match g.vm.channel(left()) {
            Ok((ch, _)) => g.ch = Some(ch),
            Err(e) => {
                out.push(CheckResult::new(
                    &g.id,
                    "booted: guest address on eth0",
                    GUEST_CIDR.into(),
                    e.message,
                ));
                continue;
            }
        }
        let v4 = g.wait_addresses(GUEST_CIDR, "-4", left());
        out.push(CheckResult::new(
            &g.id,
            "booted: guest address on eth0",
            GUEST_CIDR.into(),
            v4,
        ));
        if let Some(m) = g.mesh {
            let want = format!("{m}/128");
            let seen = g.wait_addresses(&want, "-6", left());
            out.push(CheckResult::new(
                &g.id,
                "booted: vmnet-guest put the mesh address on eth0",
                want,
                seen,
            ));
        }
        g.ready_secs = Some(g.vm.started.elapsed().as_secs_f64());
        if g.mesh.is_some() {
            let routes = g.routes_via_host();
            out.push(CheckResult::new(
                &g.id,
                "host routes from metadata",
                expected_routes(&g.host_routes6),
                routes,
            ));
        }
        let started = g.sh(
            &format!(
                "cat >/run/vmnet-echo.py <<'EOF'\n{ECHO_PY}EOF\ncat >/run/vmnet-probe.py <<'EOF'\n{PROBE_PY}EOF\n\
                 systemd-run --quiet --unit vmnet-echo python3 /run/vmnet-echo.py && echo started"
            ),
            Duration::from_secs(20),
        );
        if started != "started" {
            out.push(CheckResult::new(
                &g.id,
                "echo service",
                "started".into(),
                started,
            ));
        }
    }
    out
}

/// The guest's address and prefix, as the image configures it.
pub const GUEST_CIDR: &str = "172.16.0.2/30";

/// Runs `probe.py` in guest `g` (`kind` `tcp`, `udp` or `mss`); for an MSS probe with a route to the target advertising
/// `advmss` in place for its duration.
pub fn probe(
    g: &mut NsGuest,
    kind: &str,
    target: std::net::SocketAddr,
    advmss: Option<u16>,
) -> String {
    let ip = target.ip();
    let run = format!("python3 /run/vmnet-probe.py {kind} {ip} {}", target.port());
    let script = match (advmss, ip) {
        (None, _) => run,
        (Some(m), IpAddr::V4(a)) => format!(
            "ip route add {a}/32 via 172.16.0.1 dev eth0 advmss {m}\n{run}\nip route del {a}/32"
        ),
        (Some(m), IpAddr::V6(a)) => format!(
            "ip -6 route add {a}/128 via fe80::1 dev eth0 advmss {m}\n{run}\nip -6 route del {a}/128"
        ),
    };
    g.sh(&script, Duration::from_secs(15))
}

/// Runs the planned checks of `infos` (one per guest, in the same order) from the real guests;
/// `gateway …` checks are left out (see the module docs).
pub fn run_checks(guests: &mut [NsGuest], infos: &[GuestInfo]) -> Vec<CheckResult> {
    let (plans, _) = plan_checks(infos);
    let mut out = Vec::new();
    for p in plans {
        let v = &infos[p.vm];
        let g = &mut guests[p.vm];
        let seen = match p.probe {
            Probe::Gateway { .. } => continue,
            Probe::Tcp(t) => {
                // As with simulated guests: a path through a gateway can take a moment to settle.
                let mut s = probe(g, "tcp", t, None);
                for _ in 0..2 {
                    if s != NO_REACH || p.expected == NO_REACH {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                    s = probe(g, "tcp", t, None);
                }
                s
            }
            Probe::Udp(t) => probe(g, "udp", t, None),
            Probe::Mss { target, advmss } => probe(g, "mss", target, Some(advmss)),
            Probe::InetTcp(_) | Probe::InetUdp(_) | Probe::NatRule | Probe::VethMtu => {
                crate::ns_job::probes::run_host_probe(v, &p.probe)
            }
        };
        out.push(CheckResult {
            vm: v.vm.clone(),
            check: p.name,
            ok: seen == p.expected,
            expected: p.expected,
            seen,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_expected_are_the_mesh_range_and_the_ipv6_routes_via_host() {
        assert_eq!(expected_routes(&[]), "fdaa::/16");
        assert_eq!(
            expected_routes(&["::/0".into(), "2001:db8::/32".into()]),
            "2001:db8::/32, default, fdaa::/16"
        );
    }

    #[test]
    fn nic_args_name_the_tap_and_mac() {
        assert_eq!(
            nic_args("t1", "06:00:ac:10:00:02"),
            [
                "-netdev",
                "tap,id=net0,ifname=t1,script=no,downscript=no",
                "-device",
                "virtio-net-pci,netdev=net0,mac=06:00:ac:10:00:02"
            ]
        );
    }
}
