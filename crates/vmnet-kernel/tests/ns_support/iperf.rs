//! Throughput measurements with Debian's iperf3 between namespaces of a sandbox, and a private
//! peer: a namespace on the sandbox host's private network.

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use vmnet_testkit::{Sandbox, netns};

/// Bytes per MiB.
pub const MIB: f64 = 1_048_576.0;

/// The private peer's IPv4 address (on the sandbox host's private network 10.99.0.0/24).
pub const PRIVATE_V4: &str = "10.99.0.1";
/// The private peer's IPv6 address (a mesh address, routed by the sandbox host).
pub const PRIVATE_V6: &str = "fdaa:ffff::1";

/// A namespace `<prefix>x-priv` on a private network behind the sandbox host: 10.99.0.1/24 and
/// `fdaa:ffff::1/64`, default routes via the host (10.99.0.2, `fdaa:ffff::2`).
pub fn private_peer(sb: &Sandbox) -> String {
    let ns = sb.add_netns("priv").expect("private peer netns");
    let host = sb.host();
    netns::ip(
        &host,
        &[
            "link", "add", "priv0", "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ],
    )
    .expect("veth");
    for (n, dev, v4, v6) in [
        (&host, "priv0", "10.99.0.2/24", "fdaa:ffff::2/64"),
        (&ns, "eth0", "10.99.0.1/24", "fdaa:ffff::1/64"),
    ] {
        netns::ip(n, &["addr", "add", v4, "dev", dev]).expect("v4");
        netns::ip(n, &["addr", "add", v6, "dev", dev, "nodad"]).expect("v6");
        netns::ip(n, &["link", "set", dev, "up"]).expect("up");
    }
    netns::ip(&ns, &["route", "add", "default", "via", "10.99.0.2"]).expect("v4 default");
    netns::ip(
        &ns,
        &["-6", "route", "add", "default", "via", "fdaa:ffff::2"],
    )
    .expect("v6 default");
    ns
}

/// An `iperf3 -s` in a namespace, killed when dropped.
pub struct Server {
    child: Child,
    /// The address it listens on.
    pub addr: IpAddr,
    /// Its port.
    pub port: u16,
}

impl Server {
    /// Starts a server on `addr:port` in `ns` (serving one test after the other).
    pub fn start(ns: &str, addr: &str, port: u16) -> Self {
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "iperf3",
                "-s",
                "-B",
                addr,
                "-p",
                &port.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3 -s");
        Self {
            child,
            addr: addr.parse().expect("address"),
            port,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// Seconds measured (after one omitted second for TCP).
    pub secs: u32,
    /// `-R`: the server sends, the client (the guest) receives.
    pub reverse: bool,
    /// UDP offered at this rate, bytes/s (`None`: TCP).
    pub udp_rate: Option<f64>,
}

/// What the receiver got.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Application bytes per second at the receiver, MiB/s.
    pub mibps: f64,
    /// The same as IP bytes (what a limit counts): TCP 1380/1328 (MSS 1328 with timestamps),
    /// UDP (1300 + 28)/1300 (IPv4) or (1300 + 48)/1300 (IPv6).
    pub ip_mibps: f64,
    /// UDP: the share of datagrams lost at the receiver, percent.
    pub lost_percent: Option<f64>,
    /// UDP: what the sender sent, MiB/s.
    pub sent_mibps: Option<f64>,
    /// The receiver's per-interval rates, MiB/s (intervals of [`INTERVAL`]).
    pub intervals: Vec<f64>,
}

/// The reporting interval, seconds.
pub const INTERVAL: f64 = 0.1;
/// The UDP datagram payload, bytes (fits the 1380-byte MTU in IPv4 and IPv6).
pub const UDP_LEN: u32 = 1300;

/// Runs an iperf3 client in `ns` against `server`; retries while the server is not listening yet.
pub fn client(ns: &str, server: &Server, run: Run) -> Measured {
    let mut args: Vec<String> = vec![
        "-c".into(),
        server.addr.to_string(),
        "-p".into(),
        server.port.to_string(),
        "-t".into(),
        run.secs.to_string(),
        "-i".into(),
        INTERVAL.to_string(),
        "-J".into(),
    ];
    if run.reverse {
        args.push("-R".into());
    }
    match run.udp_rate {
        Some(r) => {
            let bits = format!("{:.0}", r * 8.0);
            args.extend([
                "-u".into(),
                "-b".into(),
                bits,
                "-l".into(),
                UDP_LEN.to_string(),
                "-w".into(),
                "4M".into(),
            ]);
        }
        None => args.extend(["-O".into(), "1".into()]),
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut last = String::new();
    for _ in 0..20 {
        let out = netns::exec(
            ns,
            "iperf3",
            &argv,
            Duration::from_secs(u64::from(run.secs) + 20),
        )
        .expect("iperf3 -c");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if v["error"].is_null() && !v["end"].is_null() {
            return measured(&v, run, server.addr.is_ipv6());
        }
        last = format!("{text} {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("iperf3 to {}:{} failed: {last}", server.addr, server.port);
}

fn measured(v: &Value, run: Run, v6: bool) -> Measured {
    let end = &v["end"];
    let udp = run.udp_rate.is_some();
    let (bps, lost) = if udp {
        // UDP: the receiver's totals are `sum_received` (iperf3 ≥ 3.11), `sum` before.
        let s = if end["sum_received"].is_object() {
            &end["sum_received"]
        } else {
            &end["sum"]
        };
        // The rate is the bytes received over the sending time: the receiver's own duration
        // also counts the wait for the end of the test, which a busy machine stretches.
        let secs = end["sum_sent"]["seconds"].as_f64().filter(|t| *t > 0.0);
        (
            match (s["bytes"].as_f64(), secs) {
                (Some(b), Some(t)) => b * 8.0 / t,
                _ => s["bits_per_second"].as_f64().unwrap_or(0.0),
            },
            end["sum"]["lost_percent"]
                .as_f64()
                .or(s["lost_percent"].as_f64()),
        )
    } else {
        (
            end["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(0.0),
            None,
        )
    };
    let mibps = bps / 8.0 / MIB;
    let factor = match (udp, v6) {
        (true, false) => f64::from(UDP_LEN + 28) / f64::from(UDP_LEN),
        (true, true) => f64::from(UDP_LEN + 48) / f64::from(UDP_LEN),
        (false, false) => 1380.0 / 1328.0,
        (false, true) => 1380.0 / 1308.0,
    };
    // The client's intervals are the receiver's only with -R; otherwise the server's are in
    // `server_output_json` when asked for, so the sender's intervals are used (TCP: acked data).
    let intervals = v["intervals"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|i| !i["sum"]["omitted"].as_bool().unwrap_or(false))
                .map(|i| i["sum"]["bits_per_second"].as_f64().unwrap_or(0.0) / 8.0 / MIB)
                .collect()
        })
        .unwrap_or_default();
    Measured {
        mibps,
        ip_mibps: mibps * factor,
        lost_percent: lost,
        sent_mibps: udp
            .then(|| end["sum_sent"]["bits_per_second"].as_f64())
            .flatten()
            .map(|b| b / 8.0 / MIB),
        intervals,
    }
}
