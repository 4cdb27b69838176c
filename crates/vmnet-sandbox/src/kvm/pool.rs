//! The pool-mode checks with real guests, each run from inside a guest over its command channel:
//! what cloud-init made of the seed (the lease on `eth0`, the default route, the nameservers),
//! reachability by policy, and the spoof attempts of a real guest — a foreign address added to
//! its interface and used, forged frames written to its interface (a source MAC not its own, an
//! ARP reply claiming the peer's address, a router advertisement), a DHCP server's offer sent
//! from port 67 — each looked for by a capture inside the receiving guest, next to honest
//! controls that must arrive (so "dropped" means dropped, not "the capture saw nothing").

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use vmnet_model::Error;
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_model::pool::{IpRange, PoolRange};

use super::{Channel, Vm};
use crate::pool_job::checks::{Check, check};
use crate::probe::{ALL_NODES_MAC, arp_reply_frame, icmp6_frame, udp4_frame, udp6_frame};
use crate::sandbox::ECHO_V4;

/// A real guest of the pool sandbox.
pub struct KvmGuest {
    /// Instance id.
    pub id: String,
    /// The running VM.
    pub vm: Vm,
    /// Its command channel (once it answered).
    pub ch: Option<Channel>,
    /// Its MAC.
    pub mac: MacAddr,
    /// Its lease.
    pub ip4: Ipv4Addr,
    /// Its IPv6 lease (a dual-stack pool).
    pub ip6: Option<Ipv6Addr>,
    /// Its policy.
    pub policy: NetworkPolicy,
    /// Seconds from qemu's start to network-ready, once known: cloud-init done
    /// ([`wait_booted`]), or its lease and default route seen on `eth0`
    /// ([`KvmGuest::wait_network`]).
    pub ready_secs: Option<f64>,
}

/// The guest's global IPv4 addresses on `eth0`, `addr/len`, one a line.
const LEASE: &str = "ip -4 -o addr show dev eth0 scope global | awk '{print $4}'";
/// The guest's IPv4 default route, `via GATEWAY`.
const ROUTE: &str = "ip -4 route show default | awk '{print $2, $3}'";

/// What [`LEASE`] shows once cloud-init configured `lease` in a range of prefix length `prefix`.
#[must_use]
pub fn want_lease(lease: Ipv4Addr, prefix: u8) -> String {
    format!("{lease}/{prefix}")
}

/// What [`ROUTE`] shows once cloud-init configured the default route via `gateway`.
#[must_use]
pub fn want_route(gateway: Ipv4Addr) -> String {
    format!("via {gateway}")
}

/// The script that polls, every 200 ms up to `tries` times, until `eth0` has exactly `lease`
/// and the default route is `route`, then prints both as seen, the lines of [`LEASE`], a line
/// `--`, the lines of [`ROUTE`] (read back by [`split_network`]).
fn poll_network_script(lease: &str, route: &str, tries: u128) -> String {
    format!(
        "for i in $(seq {tries}); do [ \"$({LEASE})\" = '{lease}' ] && [ \"$({ROUTE})\" = '{route}' ] && break; sleep 0.2; done\n{LEASE}; echo --; {ROUTE}"
    )
}

/// The lease lines and the route lines of [`poll_network_script`]'s output, each joined by
/// spaces (empty when the guest showed none); all of it as the lease when there is no `--`
/// line (an error from the channel).
fn split_network(out: &str) -> (String, String) {
    let join = |v: &[&str]| v.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.iter().position(|l| l.trim() == "--") {
        Some(i) => (join(&lines[..i]), join(&lines[i + 1..])),
        None => (join(&lines), String::new()),
    }
}

impl KvmGuest {
    /// Runs `script` in the guest; its output (trimmed), or `error: …`.
    pub fn sh(&mut self, script: &str, timeout: Duration) -> String {
        match self.ch.as_mut() {
            None => "error: no command channel".into(),
            Some(ch) => match ch.run(script, timeout) {
                Ok(r) => r.output.trim().to_owned(),
                Err(e) => format!("error: {e}"),
            },
        }
    }

    /// Connects the command channel once the guest answers on it, within `timeout` of its
    /// qemu's start.
    ///
    /// # Errors
    /// As [`Vm::channel`]: `INTERNAL` with the tail of the console.
    pub fn connect(&mut self, timeout: Duration) -> Result<(), Error> {
        let left = timeout.saturating_sub(self.vm.started.elapsed());
        let (ch, _) = self.vm.channel(left)?;
        self.ch = Some(ch);
        Ok(())
    }

    /// The lease on `eth0` as the guest shows it (`addr/len`; see [`want_lease`]).
    pub fn lease(&mut self) -> String {
        self.sh(LEASE, Duration::from_secs(10))
    }

    /// The default route as the guest shows it (`via GATEWAY`; see [`want_route`]).
    pub fn default_route(&mut self) -> String {
        self.sh(ROUTE, Duration::from_secs(10))
    }

    /// Waits until cloud-init configured the network: the command channel, then `eth0` with
    /// exactly `lease` (`addr/len`) and the default route `route` (`via GATEWAY`), polled in
    /// the guest every 200 ms, all within `timeout` of qemu's start. The seconds from qemu's
    /// start to the moment both were seen (also kept in `ready_secs`).
    ///
    /// # Errors
    /// `INTERNAL` naming the guest when the channel does not answer, or with what `eth0` had
    /// when `timeout` passed.
    pub fn wait_network(
        &mut self,
        lease: &str,
        route: &str,
        timeout: Duration,
    ) -> Result<f64, Error> {
        self.connect(timeout)?;
        let left = timeout
            .saturating_sub(self.vm.started.elapsed())
            .max(Duration::from_secs(5));
        let script = poll_network_script(lease, route, left.as_millis() / 200 + 1);
        let seen = self.sh(&script, left + Duration::from_secs(5));
        let secs = self.vm.started.elapsed().as_secs_f64();
        let (got_lease, got_route) = split_network(&seen);
        if got_lease != lease || got_route != route {
            return Err(Error::internal(format!(
                "guest {}: eth0 has {got_lease:?} and the default route {got_route:?}, not {lease} and {route}; console: {}",
                self.id,
                crate::state::log_tail(&self.vm.console)
            )));
        }
        self.ready_secs = Some(secs);
        Ok(secs)
    }
}

/// Waits for every guest (booted in parallel): its command channel, then `cloud-init status
/// --wait`, each within `timeout` of its qemu's start. One check per guest.
pub fn wait_booted(guests: &mut [KvmGuest], timeout: Duration) -> Vec<Check> {
    let mut out = Vec::new();
    for g in guests.iter_mut() {
        let started = g.vm.started;
        let seen = match g.connect(timeout) {
            Err(e) => e.message,
            Ok(()) => {
                let left = timeout
                    .saturating_sub(started.elapsed())
                    .max(Duration::from_secs(5));
                let s = g.sh(
                    "cloud-init status --wait >/dev/null; cloud-init status",
                    left,
                );
                if s.contains("status: done") {
                    g.ready_secs = Some(started.elapsed().as_secs_f64());
                    "status: done".to_owned()
                } else {
                    format!("{s}; console: {}", crate::state::log_tail(&g.vm.console))
                }
            }
        };
        out.push(check(
            format!("{}: booted, cloud-init finished", g.id),
            "status: done",
            seen,
        ));
    }
    out
}

fn passes(ok: bool) -> &'static str {
    if ok { "passes" } else { "dropped" }
}

fn ping(g: &mut KvmGuest, to: impl std::fmt::Display) -> String {
    let s = g.sh(
        &format!("ping -c 3 -i 0.3 -W 2 -q {to} >/dev/null && echo passes || echo dropped"),
        Duration::from_secs(15),
    );
    s.lines().last().unwrap_or_default().to_owned()
}

/// Runs the checks (blocking). `dns` are the range's nameservers.
pub fn run(guests: &mut [KvmGuest], range: &IpRange, dns: &[String]) -> Vec<Check> {
    let mut out = Vec::new();
    let prefix = range.cidr.prefix_len();
    let t = Duration::from_secs(10);
    for g in guests.iter_mut().filter(|g| g.ch.is_some()) {
        let addr = g.lease();
        out.push(check(
            format!("{}: cloud-init put the lease on eth0", g.id),
            want_lease(g.ip4, prefix),
            addr,
        ));
        let route = g.default_route();
        out.push(check(
            format!("{}: default route", g.id),
            want_route(range.gateway),
            route,
        ));
        let ns = g.sh("resolvectl dns eth0 | sed 's/^[^:]*: *//'", t);
        out.push(check(format!("{}: nameservers", g.id), dns.join(" "), ns));
    }
    for g in guests.iter_mut().filter(|g| g.ch.is_some()) {
        if crate::state::stopping() {
            return out;
        }
        let exp = g.policy != NetworkPolicy::None;
        let seen = ping(g, range.gateway);
        out.push(check(
            format!("{} ({:?}) → gateway, from the guest", g.id, g.policy).to_lowercase(),
            passes(exp),
            seen,
        ));
        let exp = g.policy == NetworkPolicy::Public;
        let seen = ping(g, ECHO_V4);
        out.push(check(
            format!(
                "{} ({:?}) → internet {ECHO_V4}, from the guest",
                g.id, g.policy
            )
            .to_lowercase(),
            passes(exp),
            seen,
        ));
    }
    let idx: Vec<usize> = (0..guests.len())
        .filter(|&i| guests[i].policy == NetworkPolicy::Public && guests[i].ch.is_some())
        .collect();
    let (Some(&ai), Some(&bi)) = (idx.first(), idx.get(1)) else {
        return out;
    };
    let b4 = guests[bi].ip4;
    let seen = ping(&mut guests[ai], b4);
    out.push(check(
        format!("{} → {}, from the guest", guests[ai].id, guests[bi].id),
        "passes",
        seen,
    ));
    let nones: Vec<Ipv4Addr> = guests
        .iter()
        .filter(|g| g.policy == NetworkPolicy::None)
        .map(|g| g.ip4)
        .collect();
    for n in nones {
        let seen = ping(&mut guests[ai], n);
        out.push(check(
            format!("{} → {n} (none), from the guest", guests[ai].id),
            "dropped",
            seen,
        ));
    }
    let (lo, hi) = guests.split_at_mut(bi);
    out.extend(spoofs(&mut lo[ai], &mut hi[0]));
    out
}

/// The guest's global IPv6 addresses on `eth0`, `addr/len`, one a line.
const LEASE6: &str = "ip -6 -o addr show dev eth0 scope global | awk '{print $4}'";
/// The guest's IPv6 default route, `via GATEWAY`.
const ROUTE6: &str = "ip -6 route show default | awk '{print $2, $3}'";

/// The IPv6 checks of a dual-stack pool (blocking), from inside the guests: cloud-init put
/// the IPv6 lease on `eth0` (`r` the IPv6 range) and the IPv6 default route via its gateway
/// (`gateway6`); each guest pings the IPv6 gateway (passes unless its policy is `none`), the
/// first public guest pings the second by its IPv6 lease (passes) and each `none` guest's
/// (dropped).
pub fn run6(guests: &mut [KvmGuest], r: &PoolRange) -> Vec<Check> {
    let mut out = Vec::new();
    let t = Duration::from_secs(10);
    for g in guests.iter_mut().filter(|g| g.ch.is_some()) {
        let want = g.ip6.map_or_else(
            || "no IPv6 lease".to_owned(),
            |a| format!("{a}/{}", r.cidr.prefix_len()),
        );
        let seen = g.sh(LEASE6, t);
        out.push(check(
            format!("{}: cloud-init put the IPv6 lease on eth0", g.id),
            want,
            seen,
        ));
        let seen = g.sh(ROUTE6, t);
        out.push(check(
            format!("{}: IPv6 default route", g.id),
            format!("via {}", r.gateway),
            seen,
        ));
    }
    for g in guests.iter_mut().filter(|g| g.ch.is_some()) {
        if crate::state::stopping() {
            return out;
        }
        let exp = g.policy != NetworkPolicy::None;
        let seen = ping(g, r.gateway);
        out.push(check(
            format!(
                "{} ({:?}) → IPv6 gateway {}, from the guest",
                g.id, g.policy, r.gateway
            )
            .to_lowercase(),
            passes(exp),
            seen,
        ));
    }
    let idx: Vec<usize> = (0..guests.len())
        .filter(|&i| guests[i].policy == NetworkPolicy::Public && guests[i].ch.is_some())
        .collect();
    let (Some(&ai), Some(Some(b6))) = (idx.first(), idx.get(1).map(|&bi| guests[bi].ip6)) else {
        return out;
    };
    let seen = ping(&mut guests[ai], b6);
    out.push(check(
        format!("{} → {b6} over IPv6, from the guest", guests[ai].id),
        "passes",
        seen,
    ));
    let nones: Vec<Ipv6Addr> = guests
        .iter()
        .filter(|g| g.policy == NetworkPolicy::None)
        .filter_map(|g| g.ip6)
        .collect();
    for n in nones {
        let seen = ping(&mut guests[ai], n);
        out.push(check(
            format!("{} → {n} (none) over IPv6, from the guest", guests[ai].id),
            "dropped",
            seen,
        ));
    }
    out
}

/// The capture inside the receiver: every incoming frame holding a `vmnet-kvm-` marker is
/// written to /run/vmnet-seen for `secs` seconds.
const SNIFF: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.bind(("eth0", 0)); s.settimeout(0.2)
end = time.time() + float(sys.argv[1])
f = open("/run/vmnet-seen", "a")
open("/run/vmnet-sniff.ready", "w").close()
while time.time() < end:
    try:
        d, a = s.recvfrom(65535)
    except socket.timeout:
        continue
    if a[2] == socket.PACKET_OUTGOING:
        continue
    i = d.find(b"vmnet-kvm-")
    if i >= 0:
        f.write(d[i:i + 48].decode("latin1") + "\n"); f.flush()
"#;

/// How a spoof case is sent from inside the sender.
enum Send {
    /// A frame written to `eth0` through an `AF_PACKET` socket.
    Frame(Vec<u8>),
    /// A UDP datagram from the guest's own stack: source address (bound), destination, source
    /// port, destination port.
    Udp(Ipv4Addr, Ipv4Addr, u16, u16),
}

fn send_script(how: &Send, marker: &str) -> String {
    match how {
        Send::Frame(f) => {
            let hex: String = f.iter().map(|b| format!("{b:02x}")).collect();
            format!(
                "python3 -c 'import socket,sys; s=socket.socket(socket.AF_PACKET,socket.SOCK_RAW); s.bind((\"eth0\",0)); s.send(bytes.fromhex(sys.argv[1]))' {hex}"
            )
        }
        Send::Udp(src, dst, sport, dport) => format!(
            "python3 -c 'import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET,socket.SO_BROADCAST,1); s.bind((sys.argv[1],{sport})); s.sendto(sys.argv[3].encode(),(sys.argv[2],{dport}))' {src} {dst} {marker}"
        ),
    }
}

/// The spoof suite from `a` towards `b` (both real guests).
fn spoofs(a: &mut KvmGuest, b: &mut KvmGuest) -> Vec<Check> {
    let label = format!("{} → {}, from the guest", a.id, b.id);
    let started = b.sh(
        &format!(
            "rm -f /run/vmnet-seen /run/vmnet-sniff.ready; cat >/run/vmnet-sniff.py <<'EOF'\n{SNIFF}\nEOF\nsetsid python3 /run/vmnet-sniff.py 90 </dev/null >/dev/null 2>&1 &\nfor i in $(seq 100); do [ -e /run/vmnet-sniff.ready ] && echo ready && exit 0; sleep 0.1; done; echo not ready"
        ),
        Duration::from_secs(20),
    );
    if started != "ready" {
        return vec![check(
            format!("{label}: capture in the receiver"),
            "ready",
            started,
        )];
    }
    let tag = std::process::id();
    let (am, bm, a4, b4) = (a.mac, b.mac, a.ip4, b.ip4);
    let foreign_mac = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
    let foreign4 = Ipv4Addr::from(u32::from(b4).wrapping_add(100));
    let (ll_a, ll_b) = (am.link_local_v6(), bm.link_local_v6());
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    type Build = Box<dyn Fn(&[u8]) -> Send>;
    let cases: Vec<(String, bool, Build)> = vec![
        (
            "honest UDP from its own address".into(),
            true,
            Box::new(move |_| Send::Udp(a4, b4, 4000, 4001)),
        ),
        (
            format!("foreign address {foreign4} added to eth0 and used"),
            false,
            Box::new(move |_| Send::Udp(foreign4, b4, 4000, 4001)),
        ),
        (
            "frame with a foreign source MAC".into(),
            false,
            Box::new(move |m| Send::Frame(udp4_frame(bm, foreign_mac, a4, b4, (4000, 4001), m))),
        ),
        (
            "honest ARP reply".into(),
            true,
            Box::new(move |m| Send::Frame(arp_reply_frame(bm, am, (am, a4), (bm, b4), m))),
        ),
        (
            "forged ARP reply (claims the peer's address)".into(),
            false,
            Box::new(move |m| Send::Frame(arp_reply_frame(bm, am, (am, b4), (bm, b4), m))),
        ),
        (
            "DHCP server: an offer from port 67 to broadcast".into(),
            false,
            Box::new(move |_| Send::Udp(a4, Ipv4Addr::BROADCAST, 67, 68)),
        ),
        (
            "honest IPv6 link-local frame".into(),
            true,
            Box::new(move |m| Send::Frame(udp6_frame(bm, am, ll_a, ll_b, (4000, 4001), m))),
        ),
        (
            "router advertisement".into(),
            false,
            Box::new(move |m| Send::Frame(icmp6_frame(ALL_NODES_MAC, am, ll_a, all_nodes, 134, m))),
        ),
    ];
    let added = a.sh(
        &format!("ip addr add {foreign4}/32 dev eth0 && echo added"),
        Duration::from_secs(10),
    );
    let mut sent = Vec::new();
    for (i, (_, _, build)) in cases.iter().enumerate() {
        let marker = format!("vmnet-kvm-{tag}-{i}.");
        let how = build(marker.as_bytes());
        let out = a.sh(
            &format!("{} && echo sent", send_script(&how, &marker)),
            Duration::from_secs(10),
        );
        sent.push((marker, out.ends_with("sent")));
    }
    let _ = a.sh(
        &format!("ip addr del {foreign4}/32 dev eth0"),
        Duration::from_secs(10),
    );
    std::thread::sleep(Duration::from_secs(1));
    let seen = b.sh("cat /run/vmnet-seen 2>/dev/null", Duration::from_secs(10));
    cases
        .iter()
        .zip(sent)
        .map(|((name, arrives, _), (marker, ok))| {
            let s = if !ok || (name.starts_with("foreign address") && added != "added") {
                "not sent"
            } else if seen.contains(&marker) {
                "arrives"
            } else {
                "dropped"
            };
            check(
                format!("{label}: {name}"),
                if *arrives { "arrives" } else { "dropped" },
                s,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn want_strings_are_what_ip_and_awk_show() {
        assert_eq!(want_lease(Ipv4Addr::new(10, 0, 0, 2), 29), "10.0.0.2/29");
        assert_eq!(want_route(Ipv4Addr::new(10, 0, 0, 1)), "via 10.0.0.1");
    }

    #[test]
    fn poll_script_compares_both_and_prints_both() {
        let s = poll_network_script("10.0.0.2/29", "via 10.0.0.1", 5);
        assert!(s.starts_with("for i in $(seq 5); do "));
        assert!(s.contains(&format!("[ \"$({LEASE})\" = '10.0.0.2/29' ]")));
        assert!(s.contains(&format!("[ \"$({ROUTE})\" = 'via 10.0.0.1' ]")));
        assert!(s.ends_with(&format!("\n{LEASE}; echo --; {ROUTE}")));
    }

    #[test]
    fn split_network_reads_lease_and_route() {
        let ok = split_network("10.0.0.2/29\n--\nvia 10.0.0.1");
        assert_eq!(ok, ("10.0.0.2/29".into(), "via 10.0.0.1".into()));
        assert_eq!(
            split_network("--\nvia 10.0.0.1"),
            (String::new(), "via 10.0.0.1".into())
        );
        assert_eq!(
            split_network("10.0.0.2/29\n10.0.0.9/29\n--"),
            ("10.0.0.2/29 10.0.0.9/29".into(), String::new())
        );
        assert_eq!(
            split_network("error: timed out"),
            ("error: timed out".into(), String::new())
        );
    }
}
