//! Shared helpers for the namespace-mode driver tests: a sandbox (testkit) with a driver whose
//! host is the sandbox host namespace, VM plans, simulated guests and read-back through `ip`.

#![allow(dead_code)]

use std::net::Ipv6Addr;
use std::sync::Arc;
use std::time::Duration;

use vmnet_kernel::activity::ActivityRecorder;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{HOST_LINK_LOCAL, NsSettings, VmPlan, plan_vm};
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::{Sandbox, netns};

/// How long one traffic check may take: long enough for two TCP SYN retransmits (1 s, 3 s), as
/// a first SYN can be lost on a loaded machine while the new links settle.
pub const T: Duration = Duration::from_secs(5);

/// A sandbox and a driver managing VMs inside it.
pub struct Env {
    pub driver: Arc<dyn NsDriver>,
    pub settings: NsSettings,
    /// The activity program and its test-unique pin root, with [`Env::with_activity`].
    pub activity: Option<(Arc<ActivityRecorder>, PinRoot)>,
    // Dropped last: removes every namespace of the sandbox, VM namespaces included.
    pub sb: Sandbox,
}

impl Env {
    /// A fresh sandbox; the driver's host is the sandbox host, its prefix the sandbox prefix.
    pub fn new() -> Self {
        Self::with(|_| {})
    }

    /// As [`Env::new`], with settings adjusted by `f` (the name prefix is the sandbox's).
    pub fn with(f: impl FnOnce(&mut NsSettings)) -> Self {
        vmnet_testkit::require_root();
        let sb = Sandbox::new("ns").expect("sandbox");
        let mut settings = NsSettings::default();
        f(&mut settings);
        settings.name_prefix = sb.agent_prefix();
        let driver = NetlinkNsDriver::new(settings.clone(), Some(sb.host())).expect("driver");
        Self {
            driver: Arc::new(driver),
            settings,
            activity: None,
            sb,
        }
    }

    /// As [`Env::new`], with packet activity on: the program loaded with its maps pinned under a
    /// test-unique bpffs root (removed on drop).
    pub fn with_activity() -> Self {
        // Roots a killed test run left keep a program attached: removed first.
        let _ = vmnet_testkit::sandbox::sweep_stale_pin_roots();
        let mut env = Self::with(|s| s.activity = true);
        let root = PinRoot(std::env::temp_dir().join(format!("{}-bpf", env.sb.agent_prefix())));
        let rec = Arc::new(ActivityRecorder::open(&root.0).expect("load the activity program"));
        env.driver = env.activity_driver(&rec);
        env.activity = Some((rec, root));
        env
    }

    /// A new driver (as a restarted agent makes) with `rec` as its activity program.
    pub fn activity_driver(&self, rec: &Arc<ActivityRecorder>) -> Arc<dyn NsDriver> {
        let driver = NetlinkNsDriver::new(self.settings.clone(), Some(self.sb.host()))
            .expect("driver")
            .with_activity(Arc::clone(rec));
        Arc::new(driver)
    }

    /// The activity program (panics without [`Env::with_activity`]).
    pub fn recorder(&self) -> &Arc<ActivityRecorder> {
        &self.activity.as_ref().expect("env with activity").0
    }

    /// Plans a VM from its JSON config.
    pub fn plan(&self, json: &str) -> VmPlan {
        let cfg = parse_vm_config(json.as_bytes()).expect("valid config");
        plan_vm(&cfg, &self.settings).expect("plan")
    }

    /// `ip -n <sandbox host> ARGS`.
    pub fn host_ip(&self, args: &[&str]) -> String {
        netns::ip(&self.sb.host(), args).expect("ip in sandbox host")
    }

    /// The routes of host table `table` (`ip -4`/`-6`), empty when the table does not exist.
    pub fn host_table(&self, family: u8, table: u32) -> String {
        let fam = format!("-{family}");
        netns::ip(
            &self.sb.host(),
            &[&fam, "route", "show", "table", &table.to_string()],
        )
        .unwrap_or_default()
    }

    /// Attaches a simulated guest to the VM's tap through the relay, configured with the VM's
    /// mesh address and IPv6 routes to `fe80::1` for `v6_routes`, and `mtu`.
    pub fn guest(&self, name: &str, plan: &VmPlan, v6_routes: &[&str], mtu: u32) -> SimGuest {
        let cfg = GuestConfig {
            mtu,
            mesh_ipv6: plan.guest.mesh_ipv6,
            routes_v6: v6_routes
                .iter()
                .map(|d| GuestRoute6 {
                    destination: (*d).to_owned(),
                    via: Some(HOST_LINK_LOCAL),
                })
                .collect(),
            ..GuestConfig::default()
        };
        SimGuest::attach(&self.sb, name, &plan.netns, &plan.tap.name, &cfg).expect("guest")
    }
}

/// A test-unique bpffs pin root, unpinned, unmounted and removed on drop.
pub struct PinRoot(pub std::path::PathBuf);

impl Drop for PinRoot {
    fn drop(&mut self) {
        if let Err(e) = vmnet_kernel::activity::remove_root(&self.0) {
            eprintln!("removing the pin root failed: {e}");
        }
    }
}

/// A VM config JSON with routes given as `(destination, via)`.
pub fn vm_json(id: &str, uid: u32, mesh: Option<&str>, routes: &[(&str, &str)]) -> String {
    let routes: Vec<String> = routes
        .iter()
        .map(|(d, v)| format!(r#"{{"destination":"{d}","via":"{v}"}}"#))
        .collect();
    let mesh = mesh
        .map(|m| format!(r#","mesh_ipv6":"{m}""#))
        .unwrap_or_default();
    format!(
        r#"{{"id":"{id}","user_id":{uid},"tenant":1{mesh},"network":{{"routes":[{}]}}}}"#,
        routes.join(",")
    )
}

/// The MTU and ifindex of a link, read with `ip -j` in `ns`.
pub fn link_info(ns: &str, name: &str) -> Option<(u32, u32)> {
    let out = netns::ip(ns, &["-j", "link", "show", "dev", name]).ok()?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let l = &v[0];
    Some((
        u32::try_from(l["mtu"].as_u64()?).ok()?,
        u32::try_from(l["ifindex"].as_u64()?).ok()?,
    ))
}

/// `nft list ruleset` inside `ns`.
pub fn nft_ruleset(ns: &str) -> String {
    let out = netns::exec(ns, "nft", &["list", "ruleset"], T).expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Parses an IPv6 address literal.
pub fn v6(s: &str) -> Ipv6Addr {
    s.parse().expect("address")
}
pub mod iperf;
