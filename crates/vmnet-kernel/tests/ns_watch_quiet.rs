//! The watcher's quiet namespaces (root required): while a `Quiet` naming some namespaces is
//! held, their notifications are discarded and every other namespace's are sent at once; a
//! namespace named before it is watched (as a create names its new VM's) is quiet from the
//! moment its sockets are adopted; a namespace added to a held `Quiet` is quiet from then on.

use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;
use vmnet_kernel::watch::{Event, Kind, Pair, Watcher, What};
use vmnet_testkit::{Sandbox, netns};

/// How long a notification may take to arrive, and how long a discarded one is waited for.
const WAIT: Duration = Duration::from_millis(500);

/// A blackhole route to `10.99.<n>.0/24` added in `ns`: one route notification there.
fn add_route(ns: &str, n: u8) {
    let dst = format!("10.99.{n}.0/24");
    netns::ip(ns, &["route", "add", "blackhole", &dst]).unwrap();
}

/// The namespaces of the events received within `WAIT` (`None`: the host), but for learned
/// neighbour entries.
async fn namespaces_seen(events: &mut UnboundedReceiver<Event>) -> Vec<Option<String>> {
    let end = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while let Ok(Some(ev)) = tokio::time::timeout_at(end.into(), events.recv()).await {
        // Entries the sandbox host learns from traffic on its links are the kernel's.
        if let What::Changed(n) = &ev.what
            && n.kind == Some(Kind::Neigh)
            && !(n.proxy || n.permanent)
        {
            continue;
        }
        if !seen.contains(&ev.netns) {
            seen.push(ev.netns);
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_quiet_discards_only_the_namespaces_it_names() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("wq").unwrap();
    let a = sb.add_netns("a").unwrap();
    let b = sb.add_netns("b").unwrap();
    let (w, mut events) = Watcher::start(Some(&sb.host())).unwrap();
    w.watch(&a).unwrap();
    w.watch(&b).unwrap();
    // `c` does not exist yet: quiet by name, as a create's new netns is.
    let c = format!("{}x-c", sb.prefix());
    let mut quiet = w.quiet([None, Some(a.clone()), Some(c.clone())]);

    add_route(&sb.host(), 0);
    add_route(&a, 0);
    add_route(&b, 0);
    let c_made = sb.add_netns("c").unwrap();
    assert_eq!(c_made, c);
    let pair = netns::run_in(&c, Pair::open_here).unwrap().unwrap();
    w.adopt(&c, pair).unwrap();
    add_route(&c, 0);
    let seen = namespaces_seen(&mut events).await;
    assert_eq!(
        seen,
        [Some(b.clone())],
        "while quiet: only the namespace not named is seen"
    );

    // Named while held: `b` is quiet from then on.
    quiet.also([Some(b.clone())]);
    add_route(&b, 1);
    add_route(&a, 1);
    drop(quiet);
    let seen = namespaces_seen(&mut events).await;
    assert!(
        seen.is_empty(),
        "what the quiet namespaces notified is discarded with the quiet: {seen:?}"
    );

    // Released: every namespace is seen again.
    for ns in [&sb.host(), &a, &b, &c] {
        add_route(ns, 2);
    }
    let mut seen = namespaces_seen(&mut events).await;
    seen.sort();
    let mut want = vec![None, Some(a), Some(b), Some(c)];
    want.sort();
    assert_eq!(seen, want, "after the quiet");
    w.stop();
}
