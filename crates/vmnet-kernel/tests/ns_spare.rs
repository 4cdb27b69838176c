//! The mount point made ahead with the spare namespace (root required): a VM's netns is named
//! by renaming it, the next one is made, a killed agent's are swept, and none is left once the
//! driver is gone.

mod ns_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ns_support::{Env, vm_json};
use vmnet_kernel::netns::{self, NETNS_RUN_DIR, SPARE_POINT_PREFIX};

/// This process's mount points made ahead, sorted.
fn own_points() -> Vec<PathBuf> {
    let mine = format!("{SPARE_POINT_PREFIX}{}-", std::process::id());
    let mut v: Vec<PathBuf> = std::fs::read_dir(NETNS_RUN_DIR)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&mine))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Polls until `f` holds; fails with `what` after 5 s.
fn until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Files made by hand in `/run/netns`, removed on drop.
struct Files(Vec<PathBuf>);

impl Drop for Files {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn touch(p: &Path) {
    std::fs::File::create(p).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn netns_are_named_by_renaming_a_mount_point_made_ahead() {
    // A process that has exited: its mount point is stale.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let dir = Path::new(NETNS_RUN_DIR);
    std::fs::create_dir_all(dir).unwrap();
    let stale = dir.join(format!("{SPARE_POINT_PREFIX}{dead}-0"));
    let live = dir.join(format!("{SPARE_POINT_PREFIX}{}-999999", std::process::id()));
    let other = dir.join(format!("{SPARE_POINT_PREFIX}x"));
    let _files = Files(vec![stale.clone(), live.clone(), other.clone()]);
    for p in [&stale, &live, &other] {
        touch(p);
    }

    // A new driver sweeps the dead process's point only.
    let env = Env::new();
    assert!(!stale.exists(), "a dead agent's mount point is swept");
    assert!(live.exists(), "a running process's mount point is kept");
    assert!(other.exists(), "a name that is not a mount point's is kept");
    std::fs::remove_file(&live).unwrap();

    // The first create has no spare; afterwards one is made, mount point included.
    let a = env.plan(&vm_json("a", 0x51, Some("fdaa::51"), &[("::/0", "host")]));
    env.driver.apply(&a).await.unwrap();
    until("a mount point made after the first create", || {
        own_points().len() == 1
    });
    let first = own_points().remove(0);
    assert!(
        !netns::exists(first.file_name().unwrap().to_str().unwrap()),
        "the point made ahead is a plain file, not a namespace"
    );

    // The next create takes it: renamed to the VM's name, and another made.
    let b = env.plan(&vm_json("b", 0x52, Some("fdaa::52"), &[("::/0", "host")]));
    env.driver.apply(&b).await.unwrap();
    assert!(netns::exists(&b.netns), "the VM's netns is mounted");
    assert!(!first.exists(), "the point made ahead was used");
    until("the next mount point", || {
        let now = own_points();
        now.len() == 1 && now[0] != first
    });
    assert_eq!(
        netns::list(&format!("{}n", env.settings.name_prefix)).unwrap(),
        {
            let mut v = vec![a.netns.clone(), b.netns.clone()];
            v.sort();
            v
        },
        "the VMs' namespaces, nothing else under their prefix"
    );

    // Applying an unchanged VM makes nothing and uses no point up.
    let before = own_points();
    assert!(
        env.driver.apply(&b).await.is_ok(),
        "an unchanged VM applies"
    );
    assert_eq!(own_points(), before);

    // Once the driver is gone, so is its point.
    drop(env);
    until("no mount point left once the driver is dropped", || {
        own_points().is_empty()
    });
}
