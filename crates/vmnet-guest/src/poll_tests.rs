use std::collections::HashMap;

use super::*;
use crate::networkd::{Networkd, System};

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

/// Records writes and commands; fails commands whose first word is in `fail`.
#[derive(Default)]
struct FakeSystem {
    log: Vec<String>,
    fail: Option<&'static str>,
}

impl System for FakeSystem {
    fn write_atomic(&mut self, path: &std::path::Path, contents: &str) -> Result<(), String> {
        self.log
            .push(format!("write {} {}", path.display(), contents.len()));
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

impl Apply for Networkd<FakeSystem> {
    async fn apply(&mut self, net: &GuestNet) -> Result<(), String> {
        Networkd::apply(self, net).map(|_| ())
    }
}

fn poller() -> Poller<FakeFetch, Networkd<FakeSystem>> {
    Poller::new(
        FakeFetch::default(),
        Networkd::new(
            FakeSystem::default(),
            "eth0",
            std::path::Path::new("/etc/systemd/network"),
            "10-eth0.network",
        ),
    )
}

/// What the fake service answers for one path: a value, or the fetcher's error.
type Answer<'a> = Result<&'a str, &'a str>;

fn block<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn a_change_writes_then_reloads_then_resets_in_order() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok("0.0.0.0/0"));
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
    let log = &p.applier().system().log;
    assert!(
        log[0].starts_with("write /etc/systemd/network/10-eth0.network.d/50-vmnet-guest.conf ")
    );
    assert_eq!(
        log[1..],
        [
            "networkctl reload",
            "networkctl reconfigure eth0",
            "resolvectl flush-caches",
            "resolvectl reset-server-features",
            "systemctl try-restart systemd-timesyncd",
        ]
    );
    // Unchanged: nothing more is written or run.
    assert_eq!(block(p.poll()), Outcome::Unchanged);
    assert_eq!(p.applier().system().log.len(), 6);
    // A new mesh address (a warm-snapshot resume): applied again.
    p.fetcher().set(Ok("fdaa:1::8"), Ok("0.0.0.0/0"));
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
    assert_eq!(p.applier().system().log.len(), 12);
}

#[test]
fn bad_documents_keep_the_last_good_configuration() {
    let mut p = poller();
    p.fetcher().set(Ok("fdaa:1::7"), Ok(""));
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
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
    p.apply.sys_mut().fail = Some("networkctl");
    assert!(matches!(block(p.poll()), Outcome::ApplyFailed(_)));
    assert_eq!(p.applied(), None);
    p.apply.sys_mut().fail = None;
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
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
        Networkd::apply(&mut p.apply, &net),
        Ok(vec!["systemctl failed".to_owned()])
    );
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
    let runs = p.applier().system().log.len();
    assert_eq!(block(p.poll()), Outcome::Unchanged);
    assert_eq!(p.applier().system().log.len(), runs, "nothing run again");
    // A failed resolver reset does not stop the time-sync reset after it.
    p.apply.sys_mut().fail = Some("resolvectl");
    p.fetcher().set(Ok("fdaa:1::8"), Ok(""));
    assert!(matches!(block(p.poll()), Outcome::Applied(_)));
    let log = &p.applier().system().log;
    assert_eq!(
        log.last().unwrap(),
        "systemctl try-restart systemd-timesyncd"
    );
}
