//! `vmnet up --sandbox examples/pool.json`: pool mode end to end in throwaway namespaces.
//!
//! 1. IPAM in a temporary SQLite database: the spec's range (the /29 of the spec's walk-through),
//!    one host, and the instances created in order — each takes the lowest free address; the
//!    sixth of a /29 fails with `CAPACITY_UNAVAILABLE`.
//! 2. A sandbox host namespace (uplink to a fake internet, [`vmnet_testkit::Sandbox`]) with the
//!    bridge holding the range's gateway, the three bcd tables loaded through libnftables, and
//!    per placed instance: its NIC and seed from its lease, a `cidata` seed image, its rules,
//!    its persistent tap on the bridge, and a simulated guest relayed to the tap and configured
//!    from its own seed's network-config.
//! 3. The checks (reachability by policy, and each spoof attempt: expected and seen), then two
//!    tables: instances (lease, tap, MAC, seed address, policy) and checks.
//!
//! Everything runs in this process; the sandbox (namespaces, taps, database) is removed before
//! the command returns. Exit status non-zero when any check saw something other than expected.

#[path = "sandbox_pool_checks.rs"]
mod checks;

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmnet_ipam::{Db, NewInstance, SetIpPool, Store};
use vmnet_kernel::pool::firewall::PoolFirewall;
use vmnet_kernel::pool::guard::TapGuard;
use vmnet_kernel::pool::host::PoolHost;
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_kernel::pool::sim_guest;
use vmnet_kernel::pool::tap::{TapOwner, Taps};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, InstanceSpec, NetworkPolicy};
use vmnet_model::pool::IpRange;
use vmnet_plan::pool::nft::{Firewall, HostAddrs};
use vmnet_plan::pool::nic::instance_spec;
use vmnet_plan::pool::seed::seed;
use vmnet_testkit::netns as tk;
use vmnet_testkit::relay::Relay;
use vmnet_testkit::sandbox::{HOST_UPLINK_V4, HOST_UPLINK_V6, Sandbox};

use self::checks::{Check, GuestInfo};
use crate::{Global, Output};

/// One instance of a pool spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpecInstance {
    /// The instance id.
    pub instance_id: String,
    /// Its network policy.
    #[serde(default)]
    pub policy: NetworkPolicy,
    /// A sandbox instance (SSH only from the host).
    #[serde(default)]
    pub sandbox: bool,
}

/// The host of a pool spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpecHost {
    /// Host id.
    pub host_id: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Memory, MiB.
    pub memory_mib: u32,
}

/// A pool-mode sandbox spec (`examples/pool.json`): `"mode": "pool"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Always `"pool"`.
    pub mode: String,
    /// The host bridge (default `br0`).
    #[serde(default = "default_bridge")]
    pub bridge: String,
    /// The range (`setIpPool`).
    pub pool: SetIpPool,
    /// The host.
    pub host: PoolSpecHost,
    /// The instances, created in order.
    pub instances: Vec<PoolSpecInstance>,
}

fn default_bridge() -> String {
    vmnet_model::nic::DEFAULT_BRIDGE.to_owned()
}

/// Whether `text` is a pool-mode spec (a JSON object with `"mode": "pool"`).
#[must_use]
pub fn is_pool_spec(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .is_some_and(|v| v.get("mode").and_then(serde_json::Value::as_str) == Some("pool"))
}

/// One row of the instance table.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceRow {
    /// Instance id.
    pub instance: String,
    /// Policy.
    pub policy: String,
    /// The lease, or the placement error.
    pub lease: String,
    /// The tap, or `-`.
    pub tap: String,
    /// The MAC, or `-`.
    pub mac: String,
    /// The address the guest configured from its seed.
    pub seed_address: String,
}

/// What `up` prints with `--output json` for a pool spec.
#[derive(Debug, Clone, Serialize)]
pub struct PoolReport {
    /// The sandbox name.
    pub sandbox: String,
    /// Instances.
    pub instances: Vec<InstanceRow>,
    /// Checks.
    pub checks: Vec<Check>,
}

fn internal(what: &str) -> impl Fn(String) -> Error + '_ {
    move |m| Error::internal(format!("{what}: {m}"))
}

async fn place(
    spec: &PoolSpec,
    dir: &Path,
) -> Result<(IpRange, Vec<(PoolSpecInstance, Result<Ipv4Addr, Error>)>), Error> {
    let url = format!("sqlite://{}", dir.join("ipam.db").display());
    let db = Db::connect(&url).await?;
    let mut tx = db.begin().await?;
    let range = vmnet_ipam::set_ip_pool(&mut tx, spec.pool.clone()).await?;
    vmnet_ipam::add_host(
        &mut tx,
        &spec.host.host_id,
        spec.host.vcpus,
        spec.host.memory_mib,
    )
    .await?;
    tx.commit().await?;
    let mut out = Vec::new();
    for i in &spec.instances {
        let mut tx = db.begin().await?;
        let req = NewInstance {
            host_id: Some(spec.host.host_id.clone()),
            vcpus: 1,
            memory_mib: 256,
            ..NewInstance::new(i.instance_id.clone(), spec.pool.pool_id.clone())
        };
        let r = match vmnet_ipam::create_instance(&mut tx, &req).await {
            Ok(inst) => {
                tx.commit().await?;
                inst.address
                    .ok_or_else(|| Error::internal(format!("instance {}: no lease", i.instance_id)))
            }
            Err(e) => {
                tx.rollback().await?;
                Err(e)
            }
        };
        out.push((i.clone(), r));
    }
    db.close().await;
    Ok((range, out))
}

/// Runs `vmnet up --sandbox FILE` for a pool-mode spec (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` for a bad spec or name; `CONFLICT` when a sandbox of this name (under `root`
/// or by its namespaces) exists or its name and `name` are prefixes of one another;
/// `UNAVAILABLE`/`INTERNAL` when the sandbox cannot be built; `INTERNAL` when a check fails.
pub async fn up_pool(g: &Global, path: &Path, name: &str, root: &Path) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet up --sandbox must run as root (it creates network namespaces)",
        ));
    }
    super::sandbox::state::check_free(root, name)?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid(format!("pool spec {}: {e}", path.display())))?;
    let spec: PoolSpec = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("pool spec {}: {e}", path.display())))?;
    if spec.mode != "pool" {
        return Err(Error::invalid(format!(
            "pool spec {}: mode must be \"pool\"",
            path.display()
        )));
    }
    let bridge: IfName = spec.bridge.parse()?;
    let dir = std::env::temp_dir().join(format!("vmnet-pool-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::internal(format!("{}: {e}", dir.display())))?;
    let result = run(&spec, &bridge, name, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    match g.output {
        Output::Json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report)
                    .map_err(|e| Error::internal(e.to_string()))?
            );
        }
        Output::Table => print(&report),
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        return Err(Error::internal(format!(
            "{failed} of {} pool sandbox checks failed",
            report.checks.len()
        )));
    }
    Ok(())
}

async fn run(
    spec: &PoolSpec,
    bridge: &IfName,
    name: &str,
    dir: &Path,
) -> Result<PoolReport, Error> {
    let (range, placed) = place(spec, dir).await?;
    let sb = Sandbox::with_prefix(name)
        .map_err(|e| Error::unavailable(format!("sandbox {name}: {e}")))?;
    let host = sb.host();
    let gw_cidr = format!("{}/{}", range.gateway, range.cidr.prefix_len());
    let br = bridge.as_str();
    let ipf = internal("sandbox bridge");
    tk::ip(&host, &["link", "add", br, "type", "bridge"]).map_err(|e| ipf(e.to_string()))?;
    tk::ip(&host, &["addr", "add", &gw_cidr, "dev", br]).map_err(|e| ipf(e.to_string()))?;
    tk::ip(&host, &["link", "set", br, "up"]).map_err(|e| ipf(e.to_string()))?;
    tk::ip(
        &sb.inet(),
        &[
            "route",
            "add",
            &range.cidr.to_string(),
            "via",
            &HOST_UPLINK_V4.to_string(),
        ],
    )
    .map_err(|e| ipf(e.to_string()))?;
    let nft =
        LibNft::in_netns(&host).map_err(|e| Error::unavailable(format!("libnftables: {e}")))?;
    let mut firewall = PoolFirewall::new(nft);
    let host_addrs = HostAddrs {
        own: vec![
            IpAddr::V4(range.gateway),
            IpAddr::V4(HOST_UPLINK_V4),
            IpAddr::V6(HOST_UPLINK_V6),
        ],
        gateways: vec![IpAddr::V4(range.gateway)],
    };
    let guard = TapGuard::load(Some(&host))
        .map_err(|e| Error::unavailable(format!("tap guard: {}", error_chain(&e))))?;
    guard
        .set_host(&host_addrs)
        .map_err(|e| Error::unavailable(format!("tap guard: {}", error_chain(&e))))?;
    firewall
        .replace(Firewall {
            taps: vec![],
            host: host_addrs,
        })
        .map_err(|e| e.to_error())?;
    let handle =
        vmnet_kernel::netns::netlink_in(&host).map_err(|e| Error::unavailable(e.to_string()))?;
    let mut pool = PoolHost {
        firewall,
        taps: Taps::new(&host, handle),
        owner: TapOwner::default(),
        guard: Some(std::sync::Arc::new(guard)),
    };

    let mut rows = Vec::new();
    let mut guests = Vec::new();
    let mut relays = Vec::new();
    let mut started: Vec<InstanceSpec> = Vec::new();
    let mut placement = Vec::new();
    let outcome: Result<(), Error> = async {
        for (i, lease) in &placed {
            let row = |lease: String, tap: &str, mac: &str, seed_address: &str| InstanceRow {
                instance: i.instance_id.clone(),
                policy: format!("{:?}", i.policy).to_lowercase(),
                lease,
                tap: tap.into(),
                mac: mac.into(),
                seed_address: seed_address.into(),
            };
            let addr = match lease {
                Ok(a) => *a,
                Err(e) => {
                    placement.push((i.instance_id.clone(), Err(e.code)));
                    rows.push(row(format!("{}: {}", e.code, e.message), "-", "-", "-"));
                    continue;
                }
            };
            placement.push((i.instance_id.clone(), Ok(addr)));
            let alloc = format!("alloc-{}", i.instance_id);
            let inst = instance_spec(
                &i.instance_id,
                &alloc,
                bridge,
                Some((addr, &range)),
                i.policy,
                i.sandbox,
            )?;
            let s = seed(&inst, None)?;
            vmnet_kernel::pool::seed_image::write_iso(
                &s,
                &dir.join(format!("{}-seed.iso", i.instance_id)),
            )
            .map_err(|e| Error::unavailable(format!("instance {}: {e}", i.instance_id)))?;
            pool.start_instance(&inst).await.map_err(|e| e.to_error())?;
            started.push(inst.clone());
            let tap = inst.tap_names()?[0].to_string();
            let ns = sb
                .add_netns(&format!("g{}", guests.len()))
                .map_err(|e| Error::unavailable(e.to_string()))?;
            for k in ["all", "default"] {
                tk::sysctl(&ns, &format!("net/ipv6/conf/{k}/accept_dad"), "0")
                    .map_err(|e| Error::unavailable(e.to_string()))?;
            }
            relays.push(
                Relay::start(&host, &tap, &ns, "eth0")
                    .map_err(|e| Error::unavailable(e.to_string()))?,
            );
            let mac = inst.nics[0].mac;
            let net = sim_guest::configure(&ns, "eth0", mac, s.network_config.as_deref())
                .map_err(internal("simulated guest"))?;
            rows.push(row(
                addr.to_string(),
                &tap,
                &mac.to_string(),
                &net.addresses.join(","),
            ));
            guests.push(GuestInfo {
                id: i.instance_id.clone(),
                ns,
                mac,
                ip4: addr,
                policy: i.policy,
                seed_addresses: net.addresses,
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    }
    .await;
    let checks = match outcome {
        Ok(()) => {
            let (gs, pl, r) = (&guests, &placement, &range);
            let fw = &mut pool.firewall;
            tokio::task::block_in_place(|| {
                let mut all = checks::run(gs, r, pl);
                let mut audit = || fw.audit().map(|a| a.repaired).map_err(|e| error_chain(&e));
                all.extend(checks::gap(
                    gs,
                    &mut checks::GapHost {
                        ns: &host,
                        bridge: bridge.as_str(),
                        audit: &mut audit,
                    },
                ));
                all
            })
        }
        Err(_) => Vec::new(),
    };
    drop(relays);
    for inst in &started {
        let _ = pool.stop_instance(inst).await;
    }
    drop(pool);
    drop(sb);
    outcome?;
    Ok(PoolReport {
        sandbox: name.to_owned(),
        instances: rows,
        checks,
    })
}

fn print(r: &PoolReport) {
    print!("{}", render(r));
}

/// The two tables (instances, checks) in the namespace-mode layout, and the summary line.
fn render(r: &PoolReport) -> String {
    use super::sandbox::checks::render_table;
    let rows: Vec<Vec<String>> = r
        .instances
        .iter()
        .map(|i| {
            vec![
                i.instance.clone(),
                i.policy.clone(),
                i.lease.clone(),
                i.tap.clone(),
                i.mac.clone(),
                i.seed_address.clone(),
            ]
        })
        .collect();
    let mut out = format!("pool sandbox {}\n\n", r.sandbox);
    out.push_str(&render_table(
        &["INSTANCE", "POLICY", "LEASE", "TAP", "MAC", "SEED ADDRESS"],
        &rows,
    ));
    let rows: Vec<Vec<String>> = r
        .checks
        .iter()
        .map(|c| {
            vec![
                c.name.clone(),
                c.expected.clone(),
                c.seen.clone(),
                if c.ok { "ok" } else { "FAIL" }.into(),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&render_table(
        &["CHECK", "EXPECTED", "SEEN", "RESULT"],
        &rows,
    ));
    let ok = r.checks.iter().filter(|c| c.ok).count();
    out.push_str(&format!(
        "\n{ok}/{} checks ok; sandbox removed\n",
        r.checks.len()
    ));
    out
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_use_the_namespace_mode_layout_and_summary() {
        let r = PoolReport {
            sandbox: "pw1".into(),
            instances: vec![InstanceRow {
                instance: "i-1".into(),
                policy: "default".into(),
                lease: "10.0.0.2".into(),
                tap: "bc0".into(),
                mac: "02:00:00:00:00:01".into(),
                seed_address: "10.0.0.2/29".into(),
            }],
            checks: vec![
                Check {
                    name: "i-1 ping gateway".into(),
                    expected: "reply".into(),
                    seen: "reply".into(),
                    ok: true,
                },
                Check {
                    name: "i-1 forged ARP".into(),
                    expected: "dropped".into(),
                    seen: "seen".into(),
                    ok: false,
                },
            ],
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "pool sandbox pw1");
        assert!(lines[2].starts_with("INSTANCE  POLICY   LEASE"), "{text}");
        assert!(lines[3].starts_with("--------  -------"), "{text}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("CHECK") && l.ends_with("SEEN   RESULT")),
            "{text}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("i-1 forged ARP") && l.ends_with("seen   FAIL")),
            "{text}"
        );
        assert_eq!(lines.last(), Some(&"1/2 checks ok; sandbox removed"));
    }
}
