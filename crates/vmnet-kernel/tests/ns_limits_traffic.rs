//! Throughput limits with real traffic (root required): Debian's iperf3 between a simulated
//! guest (a namespace behind the VM's tap, through the testkit's frame relay: the real tap path)
//! and the fake internet (public) or a private peer on the sandbox host's private network
//! (10.99.0.1, `fdaa:ffff::1`). The relay carries GSO frames with virtio-net headers, as a
//! VMM does, so "unlimited" is shown against the bar: ten times the highest tested
//! limit (500 MiB/s). Runs are 4-5 s; the whole file takes about three minutes.
//!
//! Retries, where honest: an "at least" bar takes the best of up to four runs; a "within
//! ±5 %" bar is retried (up to three runs) only while the rate is below it, never when it is
//! above (a shaper that lets too much through fails at once). Failures list every figure.

mod ns_support;

use std::fmt::Write as _;

use ns_support::iperf::{self, MIB, Measured, Run, Server};
use ns_support::{Env, vm_json};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::sandbox::{ECHO_V4, ECHO_V6};

const UID: u32 = 0x51;

/// The measurements run one at a time: the test harness runs a file's tests in parallel, and
/// two iperf3 runs on two cores would measure each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(private: u32, public: u32) -> String {
    let base = vm_json(
        "lim",
        UID,
        Some("fdaa::51"),
        &[("0.0.0.0/0", "host"), ("::/0", "host")],
    );
    format!(
        "{},\"private_network_throughput_mibps\":{private},\"public_network_throughput_mibps\":{public}}}",
        base.strip_suffix('}').unwrap()
    )
}

struct World {
    env: Env,
    plan: VmPlan,
    guest: vmnet_testkit::guest::SimGuest,
    public_v4: Server,
    private_v4: Server,
    public_v6: Server,
    private_v6: Server,
}

/// Runs the calling thread, and every thread and process it starts from now on (the relay's two
/// threads, the iperf3 clients and servers), at nice −10. The measuring apparatus (the VMM's
/// frame relay, the guest's and the peer's iperf3) then gets the CPU before background work (a
/// compiler, other tests), which would otherwise starve a one-frame-per-system-call UDP path on
/// two cores. The shaper itself runs in the kernel and gains nothing from it.
fn favour_the_apparatus() {
    // SAFETY: plain setpriority(2) on the calling thread (who = 0); the result is checked.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
    assert_eq!(rc, 0, "setpriority: {}", std::io::Error::last_os_error());
}

async fn world(private: u32, public: u32) -> World {
    favour_the_apparatus();
    let env = Env::new();
    let plan = env.plan(&config(private, public));
    env.driver.apply(&plan).await.expect("apply");
    let peer = iperf::private_peer(&env.sb);
    let guest = env.guest("lim", &plan, &["::/0"], 1380);
    let inet = env.sb.inet();
    World {
        public_v4: Server::start(&inet, &ECHO_V4.to_string(), 5201),
        public_v6: Server::start(&inet, &ECHO_V6.to_string(), 5202),
        private_v4: Server::start(&peer, iperf::PRIVATE_V4, 5203),
        private_v6: Server::start(&peer, iperf::PRIVATE_V6, 5204),
        env,
        plan,
        guest,
    }
}

impl World {
    async fn set(&mut self, private: u32, public: u32) {
        self.plan = self.env.plan(&config(private, public));
        self.env
            .driver
            .apply(&self.plan)
            .await
            .expect("limit change");
    }

    fn run(&self, server: &Server, reverse: bool, udp_rate: Option<f64>, secs: u32) -> Measured {
        let ns = self.guest.netns().to_owned();
        iperf::client(
            &ns,
            server,
            Run {
                secs,
                reverse,
                udp_rate,
            },
        )
    }
}

fn dir(reverse: bool) -> &'static str {
    if reverse { "download" } else { "upload" }
}

/// The bar for "unlimited": ten times the highest tested limit, MiB/s.
const UNLIMITED_BAR: f64 = 10.0 * 50.0;
/// Tries for an "at least" bar: the best of this many runs counts (other work on the machine
/// only ever lowers a rate).
const BEST_OF: usize = 4;
/// Tries for a "within ±5 %" bar, retried only while the rate is below the bar: a shaper never
/// makes traffic faster than it lets through, so a rate above the bar fails at once, while a rate
/// below it can be a sender starved of CPU by other work.
const TRIES_BELOW: usize = 3;
/// Seconds per accuracy run (after one omitted second for TCP).
const SECS: u32 = 4;

/// One accuracy run against a limit of `want` MiB/s: (within the bar, above it). With `ip_check`
/// the IP-level rate (what a limit counts) must not exceed the limit by more than 5 % either;
/// the IPv6 runs skip it: GSO frames are counted without the headers of their 2nd and later
/// segments (see `vmnet_plan::ns::limits`), up to 5.5 % for IPv6 TCP.
fn accuracy_ok(m: &Measured, want: f64, ip_check: bool) -> (bool, bool) {
    let ratio = m.mibps / want;
    // Shaping, not pass-through: UDP offered well above the limit loses the excess. (A download
    // sender in the fake internet pays for the whole forwarding path in its own system calls
    // and may not reach twice 50 MiB/s on two busy cores; then there is nothing to drop.)
    let shaped = m
        .sent_mibps
        .is_none_or(|s| s < 1.5 * want || m.lost_percent.is_some_and(|l| l > 25.0));
    // The limit counts IP packets: their rate stays within 5 % of it too.
    let ip_ok = !ip_check || m.ip_mibps / want <= 1.05;
    let ok = (0.95..=1.05).contains(&ratio) && shaped && ip_ok;
    let above = ratio > 1.05 || !ip_ok || !shaped;
    (ok, above)
}

/// A UDP run whose sender could not offer even the limit (on two busy cores a download sender
/// pays for the whole forwarding path in its own system calls) and whose receiver got all of it
/// but 1 %: it shows the shaper dropped nothing below the limit, not where its ceiling is.
fn sender_bound(m: &Measured, want: f64) -> bool {
    m.sent_mibps.is_some_and(|s| {
        s < 0.95 * want && m.lost_percent.is_some_and(|l| l < 1.0) && m.mibps >= 0.95 * s
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and runs iperf3 (scripts/test.sh runs it)"]
async fn each_class_direction_and_protocol_runs_at_its_limit() {
    let _serial = SERIAL.lock().await;
    let mut w = world(0, 0).await;
    let mut table = String::from(
        "limit  class    direction proto  measured  ip-level  ratio  udp-sent  udp-loss  tries\n",
    );
    let mut bad = Vec::new();
    // Unlimited first: the baseline every limit must be far below, the best of up to
    // BEST_OF runs of 5 s.
    for (class, server) in [("private", &w.private_v4), ("public", &w.public_v4)] {
        for reverse in [false, true] {
            let mut runs = Vec::new();
            while runs.len() < BEST_OF {
                let m = w.run(server, reverse, None, 5);
                runs.push(m.mibps);
                if m.mibps >= UNLIMITED_BAR {
                    break;
                }
            }
            let best = runs.iter().copied().fold(0.0, f64::max);
            let _ = writeln!(
                table,
                "0      {class:8} {:9} tcp    {best:8.1}  {:>8}  {:>5}  {:8}  {:8}  {}",
                dir(reverse),
                "",
                "",
                "",
                "",
                runs.len()
            );
            if best < UNLIMITED_BAR {
                bad.push(format!(
                    "unlimited {class} {}: best {best:.1} MiB/s < {UNLIMITED_BAR} (10 x 50); runs {runs:.1?}",
                    dir(reverse)
                ));
            }
        }
    }
    for limit in [10u32, 50] {
        w.set(limit, limit).await;
        let want = f64::from(limit);
        for (class, server) in [("private", &w.private_v4), ("public", &w.public_v4)] {
            for reverse in [false, true] {
                let mut tcp_ok = false;
                for udp in [false, true] {
                    let mut tries = 0;
                    let (m, mut ok) = loop {
                        tries += 1;
                        let m = w.run(server, reverse, udp.then_some(2.0 * want * MIB), SECS);
                        let (ok, above) = accuracy_ok(&m, want, true);
                        if ok || above || tries == TRIES_BELOW {
                            break (m, ok);
                        }
                    };
                    if !udp {
                        tcp_ok = ok;
                    } else if !ok && sender_bound(&m, want) && tcp_ok {
                        // Nothing above the limit was offered, so this row cannot show the
                        // ceiling; the TCP row of the same limit, class and direction did.
                        ok = true;
                        let _ = writeln!(
                            table,
                            "(next row: the sender offered less than the limit and nothing was lost; the TCP row above shows the ceiling)"
                        );
                    }
                    let ratio = m.mibps / want;
                    let line = format!(
                        "{limit:<6} {class:8} {:9} {:6} {:8.2}  {:8.2}  {ratio:5.3}  {:8}  {:8}  {tries}",
                        dir(reverse),
                        if udp { "udp" } else { "tcp" },
                        m.mibps,
                        m.ip_mibps,
                        m.sent_mibps.map_or(String::new(), |s| format!("{s:.1}")),
                        m.lost_percent
                            .map_or(String::new(), |l| format!("{l:.1} %")),
                    );
                    let _ = writeln!(table, "{line}");
                    if !ok {
                        bad.push(format!("outside +-5 % (or not shaped): {line}"));
                    }
                }
            }
        }
    }
    eprintln!("{table}");
    assert!(bad.is_empty(), "{bad:#?}\n{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and runs iperf3 (scripts/test.sh runs it)"]
async fn both_classes_at_once_each_at_its_own_limit_over_ipv4_and_ipv6() {
    let _serial = SERIAL.lock().await;
    let w = world(20, 2).await;
    // Both classes at once, one direction at a time: uploads over IPv4, downloads over IPv6
    // (fdaa private, 2001:db8 public).
    let mut report = String::new();
    let mut ok = true;
    for flows in [
        [
            ("private", &w.private_v4, false, 20.0),
            ("public", &w.public_v4, false, 2.0),
        ],
        [
            ("private", &w.private_v6, true, 20.0),
            ("public", &w.public_v6, true, 2.0),
        ],
    ] {
        // Retried only while a class is below its bar and none is above (see the file's doc).
        for tries in 1..=TRIES_BELOW {
            let results: Vec<Measured> = std::thread::scope(|s| {
                let handles: Vec<_> = flows
                    .iter()
                    .map(|(_, server, reverse, _)| s.spawn(|| w.run(server, *reverse, None, SECS)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("iperf3"))
                    .collect()
            });
            let mut all_ok = true;
            let mut any_above = false;
            let mut lines = String::new();
            for ((class, server, reverse, want), m) in flows.iter().zip(&results) {
                let ratio = m.mibps / want;
                let (within, above) = accuracy_ok(m, *want, server.addr.is_ipv4());
                all_ok &= within;
                any_above |= above;
                let _ = writeln!(
                    lines,
                    "{class} {} via {}: {:.2} MiB/s, ip-level {:.2} (limit {want}, ratio {ratio:.3}, try {tries})",
                    dir(*reverse),
                    server.addr,
                    m.mibps,
                    m.ip_mibps,
                );
            }
            if all_ok || any_above || tries == TRIES_BELOW {
                ok &= all_ok;
                report.push_str(&lines);
                break;
            }
        }
    }
    eprintln!("{report}");
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and runs iperf3 (scripts/test.sh runs it)"]
async fn a_limit_change_takes_effect_in_one_pass_without_a_stall() {
    let _serial = SERIAL.lock().await;
    let mut w = world(0, 20).await;
    let ns = w.guest.netns().to_owned();
    let run = Run {
        secs: 4,
        reverse: true,
        udp_rate: None,
    };
    let measured = std::thread::scope(|s| {
        let server = &w.public_v4;
        let ns = &ns;
        let h = s.spawn(move || iperf::client(ns, server, run));
        std::thread::sleep(std::time::Duration::from_millis(3000));
        let changes = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                w.plan = w.env.plan(&config(0, 5));
                w.env.driver.apply(&w.plan).await.expect("change")
            })
        });
        assert_eq!(changes.len(), 2, "one class change per device: {changes:?}");
        assert!(
            changes.iter().all(|c| c
                .to_string()
                .contains("change class Public 20.00 MiB/s -> 5.00 MiB/s")),
            "{changes:?}"
        );
        h.join().expect("iperf3")
    });
    // One omitted second, then 4 s of 100 ms intervals; the change lands after about 2 s.
    let iv = &measured.intervals;
    eprintln!("intervals (MiB/s): {iv:.1?}");
    assert!(iv.len() >= 35, "{iv:?}");
    let before: f64 = iv[5..15].iter().sum::<f64>() / 10.0;
    let after: f64 = iv[iv.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(
        (18.0..=22.0).contains(&before),
        "before the change: {before:.2}; {iv:?}"
    );
    assert!(
        (4.5..=5.5).contains(&after),
        "after the change: {after:.2}; {iv:?}"
    );
    // A stall of more than 200 ms would leave at least one whole 100 ms interval empty.
    assert!(
        iv.iter().all(|r| *r > 0.5),
        "an interval without data: {iv:?}"
    );
}
