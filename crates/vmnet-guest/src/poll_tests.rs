use std::collections::HashMap;

use std::net::IpAddr;

use super::*;
use crate::kernel::Kernel;
use crate::networkd::{Networkd, System};
use crate::plan::{Changes, KernelRoute, Observed, gateway_of};

/// Answers each path from a table; a missing path is a 404.
#[derive(Default)]
struct FakeFetch(HashMap<&'static str, Result<String, String>>);

impl Fetch for FakeFetch {
    async fn fetch(&mut self, path: &str) -> Result<String, String> {
        self.0
            .get(path)
            .cloned()
            .unwrap_or_else(|| Err(format!("{path}: 404 Not Found")))
    }
}

impl FakeFetch {
    /// The folder as the service would answer it: a value `Err("404 …")` is a missing key, any
    /// other `Err` is the fetcher's error for the whole read.
    fn set(&mut self, mesh: Result<&str, &str>, routes: Result<&str, &str>) {
        let mut folder = serde_json::Map::new();
        for (key, v) in [("mesh-ipv6", mesh), ("host-routes", routes)] {
            match v {
                Ok(s) => {
                    folder.insert(key.into(), s.into());
                }
                Err(e) if e.starts_with("404") => {}
                Err(e) => {
                    self.0.insert(META_PATH, Err(e.to_owned()));
                    return;
                }
            }
        }
        self.0
            .insert(META_PATH, Ok(serde_json::Value::Object(folder).to_string()));
    }

    /// The folder's raw body.
    fn set_raw(&mut self, body: &str) {
        self.0.insert(META_PATH, Ok(body.to_owned()));
    }
}

/// Files in memory; records writes and commands; fails commands whose first word is `fail`.
#[derive(Default)]
struct FakeSystem {
    files: HashMap<std::path::PathBuf, String>,
    log: Vec<String>,
    fail: Option<&'static str>,
}

impl System for FakeSystem {
    fn read(&mut self, path: &std::path::Path) -> Option<String> {
        self.files.get(path).cloned()
    }
    fn write_atomic(&mut self, path: &std::path::Path, contents: &str) -> Result<(), String> {
        self.log
            .push(format!("write {} {}", path.display(), contents.len()));
        self.files.insert(path.to_owned(), contents.to_owned());
        Ok(())
    }
    fn run(&mut self, argv: &[&str]) -> Result<(), String> {
        self.log.push(argv.join(" "));
        match self.fail {
            Some(f) if argv[0] == f => Err(format!("{f} failed")),
            _ => Ok(()),
        }
    }
}

/// The interface in memory: applying changes changes it; every change is logged.
#[derive(Default, Clone)]
struct FakeKernel {
    state: Observed,
    log: Vec<String>,
    fail: bool,
}

impl Kernel for FakeKernel {
    async fn observe(&mut self) -> Result<Observed, String> {
        Ok(self.state.clone())
    }
    async fn apply(&mut self, c: &Changes) -> Result<(), String> {
        if self.fail && !c.is_empty() {
            return Err("netlink failed".into());
        }
        if let Some(a) = c.add_address {
            self.state.addresses.push((IpAddr::V6(a), 128));
            self.log.push(format!("+{a}"));
        }
        for d in &c.add_routes {
            self.state.routes.push(KernelRoute {
                dst: *d,
                gateway: Some(gateway_of(*d)),
            });
            self.log.push(format!("+{d}"));
        }
        for d in &c.del_routes {
            self.state.routes.retain(|r| r.dst != *d);
            self.log.push(format!("-{d}"));
        }
        for a in &c.del_addresses {
            self.state.addresses.retain(|(x, _)| *x != IpAddr::V6(*a));
            self.log.push(format!("-{a}"));
        }
        Ok(())
    }
}

impl Apply for Networkd<FakeSystem, FakeKernel> {
    async fn apply(&mut self, net: &GuestNet) -> Result<Applied, String> {
        Networkd::apply(self, net).await
    }
}

const DIR: &str = "/etc/systemd/network";
const BASE: &str = "[Match]\nMACAddress=06:00:ac:10:00:02\n\n[Network]\nAddress=172.16.0.2/30\nGateway=172.16.0.1\n";

/// A system with the image's `.network` file, and an interface as networkd leaves it at boot.
fn booted() -> (FakeSystem, FakeKernel) {
    let mut sys = FakeSystem::default();
    sys.files.insert(
        std::path::Path::new(DIR).join("10-eth0.network"),
        BASE.to_owned(),
    );
    let kernel = FakeKernel {
        state: Observed {
            addresses: vec![("172.16.0.2".parse().unwrap(), 30)],
            routes: vec![KernelRoute {
                dst: "0.0.0.0/0".parse().unwrap(),
                gateway: Some(gateway_of("0.0.0.0/0".parse().unwrap())),
            }],
        },
        ..FakeKernel::default()
    };
    (sys, kernel)
}

type TestPoller = Poller<FakeFetch, Networkd<FakeSystem, FakeKernel>>;

fn poller_with(sys: FakeSystem, kernel: FakeKernel) -> TestPoller {
    Poller::new(
        FakeFetch::default(),
        Networkd::new(sys, kernel, std::path::Path::new(DIR), "10-eth0.network"),
    )
}

fn poller() -> TestPoller {
    let (sys, kernel) = booted();
    poller_with(sys, kernel)
}

/// A poller of a restarted vmnet-guest: a new process over `p`'s disk and kernel.
fn restarted(p: &mut TestPoller) -> TestPoller {
    let sys = FakeSystem {
        files: p.applier().system().files.clone(),
        ..FakeSystem::default()
    };
    let kernel = FakeKernel {
        state: p.apply.kernel_mut().state.clone(),
        ..FakeKernel::default()
    };
    poller_with(sys, kernel)
}

const RESETS: [&str; 3] = [
    "resolvectl flush-caches",
    "resolvectl reset-server-features",
    "systemctl try-restart systemd-timesyncd",
];

/// What the fake service answers for one path: a value, or the fetcher's error.
type Answer<'a> = Result<&'a str, &'a str>;

fn block<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn the_first_apply_adds_what_is_missing_writes_the_drop_in_and_resets() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok("0.0.0.0/0\n::/0"));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    // The default route from the image's .network file is there already: not added again.
    assert_eq!(
        p.apply.kernel_mut().log,
        ["+fdaa:1::7", "+fdaa::/16", "+::/0"]
    );
    let log = &p.applier().system().log;
    assert!(
        log[0].starts_with("write /etc/systemd/network/10-eth0.network.d/50-vmnet-guest.conf "),
        "{log:?}"
    );
    assert_eq!(log[1..], RESETS, "no networkctl: nothing is reloaded");
    // Unchanged: nothing more is written, run or changed.
    assert_eq!(block(p.poll()), Outcome::Unchanged);
    assert_eq!(p.applier().system().log.len(), 4);
    assert_eq!(p.apply.kernel_mut().log.len(), 3);
}

#[test]
fn a_mesh_address_change_moves_only_the_address() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::8"), Ok("0.0.0.0/0\n::/0"));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    p.apply.kernel_mut().log.clear();
    p.apply.sys_mut().log.clear();
    // A warm-snapshot resume: a new mesh address.
    p.fetcher().set(Ok("fdaa:1::8008"), Ok("0.0.0.0/0\n::/0"));
    let Outcome::Applied(_, done) = block(p.poll()) else {
        panic!("not applied")
    };
    assert_eq!(p.apply.kernel_mut().log, ["+fdaa:1::8008", "-fdaa:1::8"]);
    assert_eq!(
        done.to_string(),
        "+address fdaa:1::8008/128, -address fdaa:1::8/128; drop-in written"
    );
    let log = &p.applier().system().log;
    assert!(log[0].starts_with("write "), "{log:?}");
    assert_eq!(log[1..], RESETS);
}

#[test]
fn a_host_routes_change_moves_only_those_routes() {
    let mut p = poller();
    p.fetcher()
        .set(Ok("fdaa:1::8"), Ok("::/0\n2001:db8:5::/48"));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    p.apply.kernel_mut().log.clear();
    p.fetcher()
        .set(Ok("fdaa:1::8"), Ok("::/0\n2001:db8:6::/48"));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    assert_eq!(
        p.apply.kernel_mut().log,
        ["+2001:db8:6::/48", "-2001:db8:5::/48"]
    );
    // Back to no host routes: its own routes go, the image's default route stays.
    p.apply.kernel_mut().log.clear();
    p.fetcher().set(Ok("fdaa:1::8"), Ok(""));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    assert_eq!(p.apply.kernel_mut().log, ["-::/0", "-2001:db8:6::/48"]);
}

#[test]
fn a_restart_with_unchanged_metadata_writes_and_changes_nothing() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok("0.0.0.0/0\n::/0"));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    // A new process over the same disk and kernel: it compares with them, not with its memory.
    let mut again = restarted(&mut p);
    again.fetcher().set(Ok("fdaa:1::7"), Ok("0.0.0.0/0\n::/0"));
    assert!(matches!(block(again.poll()), Outcome::InPlace(_)));
    assert!(
        again.applier().system().log.is_empty(),
        "nothing written or run"
    );
    assert!(again.apply.kernel_mut().log.is_empty(), "nothing changed");
    assert_eq!(block(again.poll()), Outcome::Unchanged);
    // A restart after the metadata changed: the routes in the drop-in on disk are its own.
    let mut third = restarted(&mut again);
    third.fetcher().set(Ok("fdaa:1::7"), Ok("0.0.0.0/0"));
    assert!(matches!(block(third.poll()), Outcome::Applied(..)));
    assert_eq!(third.apply.kernel_mut().log, ["-::/0"]);
}

#[test]
fn a_drop_in_out_of_date_on_disk_is_rewritten_without_touching_the_kernel() {
    let (mut sys, mut kernel) = booted();
    let net = crate::doc::parse("fdaa:1::7", "::/0").unwrap();
    // The kernel carries it (applied before), the disk holds an older text.
    for d in crate::plan::wanted_routes(&net) {
        kernel.state.routes.push(KernelRoute {
            dst: d,
            gateway: Some(gateway_of(d)),
        });
    }
    kernel
        .state
        .addresses
        .push((IpAddr::V6(net.mesh_ipv6), 128));
    sys.files.insert(
        std::path::Path::new(DIR).join("10-eth0.network.d/50-vmnet-guest.conf"),
        "# an older text\n".into(),
    );
    let mut p = poller_with(sys, kernel);
    p.fetcher().set(Ok("fdaa:1::7"), Ok("::/0"));
    let Outcome::Applied(_, done) = block(p.poll()) else {
        panic!("not applied")
    };
    assert!(done.changes.is_empty() && done.wrote, "{done}");
    assert!(p.apply.kernel_mut().log.is_empty());
    // Only the file changed: no resets.
    assert_eq!(p.applier().system().log.len(), 1);
}

#[test]
fn bad_documents_keep_the_last_good_configuration() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok(""));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    let good = p.applied().cloned();
    let runs = p.applier().system().log.len();
    let big = "x".repeat(crate::doc::MAX_VALUE_BYTES + 1);
    let cases: Vec<(Answer, Answer)> = vec![
        // missing
        (Err("404 Not Found"), Ok("")),
        (Ok("fdaa:1::7"), Err("404 Not Found")),
        // unreachable, cut short, over the cap (as the fetcher reports them)
        (
            Err("connect 169.254.169.254:80: Connection refused"),
            Ok(""),
        ),
        (Err("body larger than 51200 bytes or cut short"), Ok("")),
        // malformed
        (Ok("not-an-address"), Ok("")),
        (Ok("2001:db8::1"), Ok("")),
        (Ok("fdaa:1::7"), Ok("0.0.0.0/0\nbanana")),
        (Ok("{\"json\": true}"), Ok("")),
        // truncated values
        (Ok("fdaa:1:"), Ok("")),
        (Ok("fdaa:1::7"), Ok("0.0.0.0/")),
        // oversized values that did arrive
        (Ok(big.as_str()), Ok("")),
        (Ok("fdaa:1::7"), Ok(big.as_str())),
    ];
    for (mesh, routes) in cases {
        p.fetcher().set(mesh, routes);
        let out = block(p.poll());
        assert!(
            matches!(out, Outcome::Kept(_)),
            "{mesh:?} {routes:?}: {out:?}"
        );
        assert_eq!(p.applied().cloned(), good);
        assert_eq!(p.applier().system().log.len(), runs, "nothing applied");
    }
    // Bodies that are not the folder's JSON.
    for body in [
        "",
        "fdaa:1::7",
        "{\"mesh-ipv6\":",
        "[1,2]",
        "{\"mesh-ipv6\":1,\"host-routes\":\"\"}",
    ] {
        p.fetcher().set_raw(body);
        let out = block(p.poll());
        assert!(matches!(out, Outcome::Kept(_)), "{body:?}: {out:?}");
        assert_eq!(p.applied().cloned(), good);
    }
    // The document comes back: unchanged, nothing to do.
    p.fetcher().set(Ok("fdaa:1::7"), Ok(""));
    assert_eq!(block(p.poll()), Outcome::Unchanged);
}

#[test]
fn a_failed_apply_is_retried() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok(""));
    p.apply.kernel_mut().fail = true;
    assert!(matches!(block(p.poll()), Outcome::ApplyFailed(_)));
    assert_eq!(p.applied(), None);
    assert!(
        p.applier().system().log.is_empty(),
        "no drop-in before the kernel"
    );
    p.apply.kernel_mut().fail = false;
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
}

#[test]
fn a_failed_reset_is_logged_not_retried() {
    // An image without systemd-timesyncd: the reset fails, the network is applied all the same,
    // and the next poll does not reconfigure the interface again.
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok(""));
    p.apply.sys_mut().fail = Some("systemctl");
    let net = GuestNet {
        mesh_ipv6: "fdaa:1::7".parse().unwrap(),
        host_routes: Vec::new(),
    };
    assert_eq!(
        block(Networkd::apply(&mut p.apply, &net)).map(|d| d.failed_resets),
        Ok(vec!["systemctl failed".to_owned()])
    );
    assert!(matches!(block(p.poll()), Outcome::InPlace(_)));
    let runs = p.applier().system().log.len();
    assert_eq!(block(p.poll()), Outcome::Unchanged);
    assert_eq!(p.applier().system().log.len(), runs, "nothing run again");
    // A failed resolver reset does not stop the time-sync reset after it.
    p.apply.sys_mut().fail = Some("resolvectl");
    p.fetcher().set(Ok("fdaa:1::8"), Ok(""));
    assert!(matches!(block(p.poll()), Outcome::Applied(..)));
    let log = &p.applier().system().log;
    assert_eq!(
        log.last().unwrap(),
        "systemctl try-restart systemd-timesyncd"
    );
}
