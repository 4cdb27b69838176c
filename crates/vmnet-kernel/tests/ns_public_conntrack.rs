//! Conntrack entries of public addresses (root required): a UDP flow from the fake internet
//! that sends every 200 ms from one source port keeps going through delete and re-create of
//! its VM and through moving the address to another VM, with at most 1 s of loss, while a
//! third VM's entries stay.

mod ns_support;

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ns_support::{Env, v6};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::netns;
use vmnet_testkit::sandbox::HOST_UPLINK_V4;

const PORT: u16 = 9000;
const EVERY: Duration = Duration::from_millis(200);

fn vm(env: &Env, id: &str, uid: u32, public: Option<&str>) -> VmPlan {
    let public = public
        .map(|a| format!(r#","public_ipv4":"{a}""#))
        .unwrap_or_default();
    env.plan(&format!(
        r#"{{"id":"{id}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid:x}"{public},
        "network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}}]}}}}"#
    ))
}

/// Datagrams arriving in a guest namespace on 172.16.0.2:PORT, with their arrival times.
struct Receiver {
    times: Arc<Mutex<Vec<Instant>>>,
    stop: Arc<AtomicBool>,
}

impl Receiver {
    fn start(ns: &str) -> Self {
        let sock = netns::run_in(ns, || UdpSocket::bind(("172.16.0.2", PORT)))
            .expect("netns")
            .expect("bind");
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let times = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s) = (Arc::clone(&times), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                if sock.recv(&mut buf).is_ok() {
                    t.lock().unwrap().push(Instant::now());
                }
            }
        });
        Self { times, stop }
    }

    /// The first arrival at or after `since`.
    fn first_after(&self, since: Instant) -> Option<Instant> {
        self.times
            .lock()
            .unwrap()
            .iter()
            .copied()
            .find(|t| *t >= since)
    }

    fn count(&self) -> usize {
        self.times.lock().unwrap().len()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A client in the fake internet sending one datagram every 200 ms from one source port.
struct Sender(Arc<AtomicBool>);

impl Sender {
    fn start(inet: &str, to: SocketAddr) -> Self {
        let sock = netns::run_in(inet, || UdpSocket::bind(("0.0.0.0", 0)))
            .expect("netns")
            .expect("bind");
        sock.connect(to).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = sock.send(b"tick");
                std::thread::sleep(EVERY);
            }
        });
        Self(stop)
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn wait_for_arrival(r: &Receiver, since: Instant) -> Duration {
    let deadline = since + Duration::from_secs(4);
    loop {
        if let Some(t) = r.first_after(since) {
            return t - since;
        }
        assert!(Instant::now() < deadline, "no datagram arrived within 4 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn entries(env: &Env, addr: &str) -> usize {
    let a: IpAddr = addr.parse().unwrap();
    netns::run_in(&env.sb.host(), move || {
        vmnet_kernel::conntrack::count_addresses(&[a])
    })
    .expect("netns")
    .expect("conntrack")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_udp_flow_survives_re_create_and_address_move_and_other_entries_stay() {
    let env = Env::new();
    let inet = env.sb.inet();
    netns::ip(
        &inet,
        &[
            "route",
            "add",
            "198.51.100.64/26",
            "via",
            &HOST_UPLINK_V4.to_string(),
        ],
    )
    .expect("route");
    let _ = v6("::1");
    let a = vm(&env, "a", 1, Some("198.51.100.71"));
    let c = vm(&env, "c", 3, Some("198.51.100.73"));
    env.driver.apply(&a).await.expect("apply a");
    env.driver.apply(&c).await.expect("apply c");
    let ga = env.guest("a", &a, &[], 1380);
    let gc = env.guest("c", &c, &[], 1380);
    let ra = Receiver::start(ga.netns());
    let rc = Receiver::start(gc.netns());
    let _sa = Sender::start(&inet, "198.51.100.71:9000".parse().unwrap());
    let _sc = Sender::start(&inet, "198.51.100.73:9000".parse().unwrap());
    let t0 = Instant::now();
    wait_for_arrival(&ra, t0);
    wait_for_arrival(&rc, t0);
    let c_entries = entries(&env, "198.51.100.73");
    assert!(c_entries >= 1, "c's flow is tracked");

    // Delete and re-create a with the same address: the flow's next packets arrive.
    env.driver.remove(1).await.expect("remove a");
    drop(ra);
    drop(ga);
    std::thread::sleep(Duration::from_millis(600));
    env.driver.apply(&a).await.expect("re-create a");
    let ga = env.guest("a2", &a, &[], 1380);
    let ra = Receiver::start(ga.netns());
    let since = Instant::now();
    let gap = wait_for_arrival(&ra, since);
    assert!(
        gap <= Duration::from_secs(1),
        "re-created: first datagram after {gap:?}"
    );

    // Move the address from a to b: the flow follows it.
    let b = vm(&env, "b", 2, None);
    env.driver.apply(&b).await.expect("apply b");
    let gb = env.guest("b", &b, &[], 1380);
    let rb = Receiver::start(gb.netns());
    let a_without = vm(&env, "a", 1, None);
    // As the agent applies a change of the public addresses alone.
    env.driver
        .apply_public(&a_without)
        .await
        .expect("a gives the address up");
    let b_with = vm(&env, "b", 2, Some("198.51.100.71"));
    env.driver.apply_public(&b_with).await.expect("b takes it");
    let since = Instant::now();
    let gap = wait_for_arrival(&rb, since);
    assert!(
        gap <= Duration::from_secs(1),
        "moved: first datagram at b after {gap:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let a_count = ra.count();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(ra.count(), a_count, "nothing reaches a any more");

    // c's entries were never flushed and its flow never stopped.
    assert!(
        entries(&env, "198.51.100.73") >= c_entries,
        "c's entries are still there"
    );
    let c_now = rc.count();
    std::thread::sleep(Duration::from_millis(500));
    assert!(rc.count() > c_now, "c's flow goes on");
    let since = t0;
    let times = rc.times.lock().unwrap().clone();
    let worst = times
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    assert!(
        worst < Duration::from_millis(600),
        "c's flow had a gap of {worst:?} (since {since:?})"
    );
}
