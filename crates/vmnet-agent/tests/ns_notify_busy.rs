//! Drift repaired on the kernel's change notifications while the agent is busy with API changes
//! (root required): a client creates and deletes VM A back to back, so the kernel lock is held
//! by A's changes most of the time, while a NAT rule or a route of another VM (one of four,
//! taken in turn so none is repaired often enough to be backed off) is deleted by hand in its
//! netns during A's create. The lock quiets only the namespaces A's change touches, so the other
//! VM's notification is kept and it is repaired within a second; no reconcile pass runs at all
//! (none is started and the interval is an hour), so nothing else could repair it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::Method;
use common::Harness;
use serde_json::{Value, json};
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{MAIN_TABLE, NsSettings, VmPlan, plan_vm};
use vmnet_testkit::nft::nft;
use vmnet_testkit::sandbox::HOST_UPLINK_IF;
use vmnet_testkit::{Sandbox, netns};

/// How long a repair by notification may take.
const REPAIRED_WITHIN: Duration = Duration::from_secs(1);
/// The VMs changed by hand, by user id.
const VICTIMS: [u32; 4] = [0x6b, 0x6c, 0x6d, 0x6e];
/// Hand changes made during A's create before the test ends: a change made as a create is seen
/// holding the lock may outlast it (the lock is then free, or held by the next change of A).
const DURING: usize = 6;
/// Hand changes made at most (each VM's repairs stay below the back-off's 5 in 10 s).
const ROUNDS: usize = 16;

/// VM A, created and deleted by the client: everything a create makes (firewall, limits).
fn vm_a() -> Value {
    json!({"id": "ca", "user_id": 0x6a, "tenant": 1, "mesh_ipv6": "fdaa:1::6a",
        "private_network_throughput_mibps": 100, "public_network_throughput_mibps": 50,
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": {"enabled": true,
            "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["0.0.0.0/0"]}],
            "outbound": [{"protocol": "udp", "ports": "53", "prefixes": ["0.0.0.0/0"]}]}})
}

/// A VM changed by hand: it NATs (a `snat` rule in its netns table) and has routes.
fn victim(uid: u32) -> Value {
    json!({"id": format!("c{uid:x}"), "user_id": uid, "tenant": 1,
        "mesh_ipv6": format!("fdaa:1::{uid:x}"),
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}})
}

async fn status(h: &Harness) -> Value {
    h.call(Method::GET, "/v1/status", None).await.1
}

/// The kernel lock's holder and how long it has held it (ms), from `GET /v1/status`.
async fn holder(h: &Harness) -> (Option<String>, u64) {
    let k = status(h).await["kernel"].clone();
    let who = k["holder"].as_str().map(str::to_owned);
    (who, k["held_for_ms"].as_u64().unwrap_or(0))
}

/// The handle of the `snat` rule of a VM's netns table.
fn snat_handle(ns: &str, table: &str) -> Option<String> {
    let listing = nft(ns, &["-a", "list", "chain", "inet", table, "postrouting"]).unwrap();
    listing
        .lines()
        .find(|l| l.contains("snat"))
        .and_then(|l| l.rsplit_once("# handle "))
        .map(|(_, h)| h.trim().to_owned())
}

/// The routes of `table` in `ns`, as `ip` lists them.
fn routes(ns: &str, table: u32) -> String {
    netns::ip(ns, &["route", "show", "table", &table.to_string()]).unwrap()
}

/// One hand change of a VM and how to tell it was repaired.
struct Change {
    what: &'static str,
    make: Box<dyn FnOnce()>,
    repaired: Box<dyn Fn() -> bool>,
}

/// Round `round`'s change of the VM of `plan` (netns table `table`): its NAT rule or a route
/// of its main table deleted, taking turns (two of the VMs lose their rule, two a route).
fn change(plan: &VmPlan, table: &str, round: usize) -> Change {
    let ns = plan.netns.clone();
    let ns2 = ns.clone();
    let table = table.to_owned();
    if round.is_multiple_of(2) {
        let handle = snat_handle(&ns, &table).expect("the snat rule");
        let t = table.clone();
        Change {
            what: "NAT rule deleted",
            make: Box::new(move || {
                nft(
                    &ns2,
                    &[
                        "delete",
                        "rule",
                        "inet",
                        &t,
                        "postrouting",
                        "handle",
                        &handle,
                    ],
                )
                .unwrap();
            }),
            repaired: Box::new(move || snat_handle(&ns, &table).is_some()),
        }
    } else {
        let dst = plan
            .ns_routes
            .iter()
            .find(|r| r.table == MAIN_TABLE)
            .expect("a route in the main table")
            .destination
            .to_string();
        let before = routes(&ns, MAIN_TABLE);
        Change {
            what: "route deleted",
            make: Box::new(move || {
                let main = MAIN_TABLE.to_string();
                netns::ip(&ns2, &["route", "del", &dst, "table", &main]).unwrap();
            }),
            repaired: Box::new(move || routes(&ns, MAIN_TABLE) == before),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn another_vms_drift_is_repaired_on_its_notification_while_api_changes_hold_the_lock() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("nq").unwrap();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        uplink: Some(HOST_UPLINK_IF.into()),
        ..NsSettings::default()
    };
    let mut driver = NetlinkNsDriver::new(settings.clone(), Some(sb.host())).unwrap();
    let events = driver.watch_kernel().unwrap();
    let driver: Arc<dyn NsDriver> = Arc::new(driver);
    let tmp = tempfile::tempdir().unwrap();
    let h = Arc::new(Harness::open_with(tmp.path(), driver, settings.clone()).await);
    let _watch = h.agent.start_watching(events);
    let mut plans = Vec::new();
    for uid in VICTIMS {
        let v = victim(uid);
        let (st, body) = h.put_vm(&v).await;
        assert!(st.is_success(), "{st} {body}");
        plans.push(
            plan_vm(
                &parse_vm_config(v.to_string().as_bytes()).unwrap(),
                &settings,
            )
            .unwrap(),
        );
    }
    let table = sb.agent_prefix();

    // The client: A created and deleted back to back until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let changes = Arc::new(AtomicU64::new(0));
    let client = {
        let (h, stop, changes) = (Arc::clone(&h), Arc::clone(&stop), Arc::clone(&changes));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (st, body) = h.put_vm(&vm_a()).await;
                assert!(st.is_success(), "PUT A: {st} {body}");
                let (st, body) = h.delete("/v1/vms/ca").await;
                assert!(st.is_success(), "DELETE A: {st} {body}");
                changes.fetch_add(2, Ordering::Relaxed);
            }
        })
    };

    let mut times = Vec::new();
    let mut during = 0;
    let mut round = 0;
    while during < DURING {
        assert!(
            round < ROUNDS,
            "only {during} of {ROUNDS} changes were made during A's create"
        );
        let plan = &plans[round % plans.len()];
        let c = change(plan, &table, round);
        let before = status(&h).await["reconcile"].clone();
        // Made while A's create holds the kernel lock: the change is made as soon as a create
        // is seen holding it, and counts as made during it when the holder read right after is
        // the same hold.
        let wait = Instant::now();
        let (who, held0) = loop {
            let (who, held) = holder(&h).await;
            if who.as_deref() == Some("PUT vm ca") && held <= 2 {
                break (who, held);
            }
            assert!(
                wait.elapsed() < Duration::from_secs(10),
                "A's PUT never held the lock"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let start = Instant::now();
        (c.make)();
        let made = start.elapsed();
        let (who_after, held1) = holder(&h).await;
        let same_hold = who_after == who && held1 + 1 >= held0 + millis(start.elapsed());
        during += usize::from(same_hold);
        let repairs = |st: &Value| st["notifications"]["repairs_total"].as_u64();
        let took = loop {
            // Back, and counted as a repair on a notification (counted once the check ends).
            if (c.repaired)() && repairs(&status(&h).await["reconcile"]) > repairs(&before) {
                break start.elapsed();
            }
            assert!(
                start.elapsed() < REPAIRED_WITHIN,
                "round {round}, {} in {}{}: not repaired within {REPAIRED_WITHIN:?}",
                c.what,
                plan.netns,
                if same_hold { " during A's create" } else { "" }
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let after = status(&h).await["reconcile"].clone();
        assert_eq!(after["passes"], before["passes"], "no pass ran");
        let when = if same_hold {
            format!("all of it during A's create, {held1} ms into it")
        } else {
            "not all of it during A's create".to_owned()
        };
        eprintln!(
            "round {round}: {} in {} ({:.1} ms to make, {when}): repaired {:.1} ms after the change",
            c.what,
            plan.netns,
            made.as_secs_f64() * 1000.0,
            took.as_secs_f64() * 1000.0
        );
        times.push(took);
        round += 1;
    }
    stop.store(true, Ordering::Relaxed);
    client.await.unwrap();
    let ms: Vec<String> = times
        .iter()
        .map(|t| format!("{:.1}", t.as_secs_f64() * 1000.0))
        .collect();
    eprintln!(
        "change-to-repair (ms): {}; {during} of {round} changes made during A's create; {} API changes of A",
        ms.join(", "),
        changes.load(Ordering::Relaxed)
    );
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
