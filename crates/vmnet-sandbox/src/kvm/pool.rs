//! The pool-mode checks with real guests, each run from inside a guest over its command channel:
//! what cloud-init made of the seed (the lease on `eth0`, the default route, the nameservers),
//! reachability by policy, and the spoof attempts of a real guest — a foreign address added to
//! its interface and used, forged frames written to its interface (a source MAC not its own, an
//! ARP reply claiming the peer's address, a router advertisement), a DHCP server's offer sent
//! from port 67 — each looked for by a capture inside the receiving guest, next to honest
//! controls that must arrive (so "dropped" means dropped, not "the capture saw nothing").

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_model::pool::IpRange;

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
    /// Its policy.
    pub policy: NetworkPolicy,
    /// Seconds from qemu's start to cloud-init done (network configured), once known.
    pub ready_secs: Option<f64>,
}

impl KvmGuest {
    /// Runs `script` in the guest; its output (trimmed), or `error: …`.
    fn sh(&mut self, script: &str, timeout: Duration) -> String {
        match self.ch.as_mut() {
            None => "error: no command channel".into(),
            Some(ch) => match ch.run(script, timeout) {
                Ok(r) => r.output.trim().to_owned(),
                Err(e) => format!("error: {e}"),
            },
        }
    }
}

/// Waits for every guest (booted in parallel): its command channel, then `cloud-init status
/// --wait`, each within `timeout` of its qemu's start. One check per guest.
pub fn wait_booted(guests: &mut [KvmGuest], timeout: Duration) -> Vec<Check> {
    let mut out = Vec::new();
    for g in guests.iter_mut() {
        let started = g.vm.started;
        let left = timeout.saturating_sub(started.elapsed());
        let seen = match g.vm.channel(left) {
            Err(e) => e.message,
            Ok((ch, _)) => {
                g.ch = Some(ch);
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
        let addr = g.sh(
            "ip -4 -o addr show dev eth0 scope global | awk '{print $4}'",
            t,
        );
        out.push(check(
            format!("{}: cloud-init put the lease on eth0", g.id),
            format!("{}/{prefix}", g.ip4),
            addr,
        ));
        let route = g.sh("ip -4 route show default | awk '{print $2, $3}'", t);
        out.push(check(
            format!("{}: default route", g.id),
            format!("via {}", range.gateway),
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
