//! `vmnet up --sandbox examples/pool.json`: pool mode end to end in throwaway namespaces, through
//! the real agent.
//!
//! 1. A sandbox host namespace (uplink to a fake internet, [`crate::Sandbox`]) with the
//!    bridge holding the range's gateway.
//! 2. The agent (`vmnet serve --netns <host> --host-id <host> --bridge <bridge>`, this
//!    executable) with its SQLite database, socket and state in a temporary directory: it starts
//!    its root helper, loads the bcd tables and the tap guard.
//! 3. Over its API, as an operator would: the range (the /29 of the spec's walk-through), the
//!    host, and the instances in order — each takes the lowest free address and is realised
//!    (rules, tap, guard, seed) before the answer; the sixth of a /29 fails with
//!    `CAPACITY_UNAVAILABLE`. Per realised instance a simulated guest is relayed to its tap and
//!    configured from the `network-config` the agent wrote.
//! 4. The checks ([`checks`]): placement, seeds, reachability by policy, the spoof attempts, the
//!    drift gap (the agent held with `SIGSTOP`, the ruleset flushed, the guard alone; then the
//!    agent's own audit repairs it), and the teardown through the API leaving no tap and no set
//!    element. Two tables are printed: instances (lease, tap, MAC, seed address, policy) and
//!    checks.
//!
//! The sandbox (agent, namespaces, taps, database) is removed before the command returns. Exit
//! status non-zero when any check saw something other than expected.

mod agent;
mod checks;

use std::path::Path;
use std::time::Duration;

use crate::netns as tk;
use crate::relay::Relay;
use crate::sandbox::{HOST_UPLINK_V4, Sandbox};
use crate::sim_guest;
use serde::{Deserialize, Serialize};
use vmnet_agent::api::types::InstanceNics;
use vmnet_agent::client::segment;
use vmnet_model::Error;
use vmnet_model::nic::{IfName, MacAddr, NetworkPolicy};
use vmnet_model::pool::SetIpPool;

use self::agent::AgentProc;
use self::checks::{Check, GuestInfo};
use crate::state::{Paths, Proc, SandboxState};

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

impl PoolSpec {
    /// Parses and checks a pool spec before anything is built: valid JSON object, `mode`
    /// `"pool"`, a bridge name usable in the sandbox host (an interface name, not `bc…`, not
    /// `lo` or `uplink`), a valid range not overlapping the sandbox's own networks, a valid
    /// host, at least one instance, instance ids valid and distinct.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the file and the field.
    pub fn parse(file: &str, text: &str) -> Result<Self, Error> {
        let bad = |m: String| Error::invalid(format!("pool spec {file}: {m}"));
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad("must be a JSON object".into()));
        }
        let spec: Self = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
        if spec.mode != "pool" {
            return Err(bad(format!("mode {:?}: must be \"pool\"", spec.mode)));
        }
        let bridge: IfName = spec
            .bridge
            .parse()
            .map_err(|e: Error| bad(format!("bridge: {}", e.message)))?;
        if bridge.as_str().starts_with(vmnet_model::nic::TAP_PREFIX)
            || ["lo", "uplink"].contains(&bridge.as_str())
        {
            return Err(bad(format!(
                "bridge {:?}: names starting with \"{}\" are instance taps, and lo and uplink exist in the sandbox host",
                bridge.as_str(),
                vmnet_model::nic::TAP_PREFIX
            )));
        }
        let range = spec.pool.validate().map_err(|e| bad(e.message))?;
        let sandbox_nets: [(&str, ipnet::Ipv4Net); 2] = [
            (
                "the sandbox uplink",
                ipnet::Ipv4Net::new(HOST_UPLINK_V4, crate::sandbox::UPLINK_V4_LEN)
                    .map_err(|e| Error::internal(e.to_string()))?
                    .trunc(),
            ),
            (
                "the fake internet's echo network",
                ipnet::Ipv4Net::new(crate::sandbox::ECHO_V4, 24)
                    .map_err(|e| Error::internal(e.to_string()))?
                    .trunc(),
            ),
        ];
        for (what, net) in sandbox_nets {
            if net.contains(&range.cidr.network()) || range.cidr.contains(&net.network()) {
                return Err(bad(format!(
                    "pool.cidr {} overlaps {what} {net}",
                    range.cidr
                )));
            }
        }
        vmnet_model::pool::validate_id("host.host_id", &spec.host.host_id)
            .map_err(|e| bad(e.message))?;
        if spec.host.vcpus == 0 || spec.host.memory_mib == 0 {
            return Err(bad("host: vcpus and memory_mib must be at least 1".into()));
        }
        if spec.instances.is_empty() {
            return Err(bad("instances: at least one is needed".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (n, i) in spec.instances.iter().enumerate() {
            vmnet_model::pool::validate_id(&format!("instances[{n}].instance_id"), &i.instance_id)
                .map_err(|e| bad(e.message))?;
            if !seen.insert(i.instance_id.as_str()) {
                return Err(bad(format!(
                    "instances[{n}].instance_id {:?} appears twice",
                    i.instance_id
                )));
            }
        }
        Ok(spec)
    }
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

/// Runs `vmnet up --sandbox FILE` for a pool-mode spec (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` for a bad spec or name; `CONFLICT` when a sandbox of this name (under `root`
/// or by its namespaces) exists or its name and `name` are prefixes of one another;
/// `UNAVAILABLE`/`INTERNAL` when the sandbox cannot be built; `INTERNAL` when a check fails.
pub async fn up_pool(
    json: bool,
    path: &Path,
    name: &str,
    root: &Path,
    timeout: Duration,
    mut interrupts: crate::state::Interrupts,
) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet up --sandbox must run as root (it creates network namespaces)",
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid(format!("pool spec {}: {e}", path.display())))?;
    let spec = PoolSpec::parse(&path.display().to_string(), &text)?;
    let bridge: IfName = spec.bridge.parse()?;
    let paths = crate::state::claim(root, name)?;
    // An interrupt (SIGINT, SIGTERM) drops the run: its guards stop the agent and delete the
    // namespaces before this returns.
    // The checks look at `stopping()` and end early, so the interrupt is seen within a check.
    let result = tokio::select! {
        biased;
        why = interrupts.wait() => Err(crate::state::interrupted_error(why, name)),
        r = run(&spec, &bridge, name, &paths, timeout) => r,
    };
    let _ = std::fs::remove_dir_all(&paths.dir);
    let report = result?;
    match json {
        true => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report)
                    .map_err(|e| Error::internal(e.to_string()))?
            );
        }
        false => print(&report),
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
    paths: &Paths,
    timeout: Duration,
) -> Result<PoolReport, Error> {
    let dir = &paths.dir;
    let range_net: ipnet::Ipv4Net = spec
        .pool
        .cidr
        .parse()
        .map_err(|e| Error::invalid(format!("pool {}: cidr: {e}", spec.pool.pool_id)))?;
    let sb = Sandbox::with_prefix(name).map_err(|e| {
        Error::conflict(format!(
            "{e}: run `vmnet down --sandbox --name {name}` first"
        ))
    })?;
    let host = sb.host();
    let mut st = SandboxState {
        name: name.to_owned(),
        host_ns: host.clone(),
        inet_ns: sb.inet(),
        ..SandboxState::default()
    };
    paths.save(&st)?;
    let gw_cidr = format!("{}/{}", spec.pool.gateway, range_net.prefix_len());
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
            &range_net.trunc().to_string(),
            "via",
            &HOST_UPLINK_V4.to_string(),
        ],
    )
    .map_err(|e| ipf(e.to_string()))?;

    let agent = AgentProc::start(spec, &host, name, dir, timeout).await?;
    // Recorded so `vmnet down --sandbox` can stop it should this process die without cleaning up.
    st.procs.push(Proc {
        role: "agent".into(),
        pid: agent.pid(),
    });
    paths.save(&st)?;
    let mut rows = Vec::new();
    let mut guests = Vec::new();
    let mut relays = Vec::new();
    let mut created = Vec::new();
    let mut placement = Vec::new();
    let mut range = None;
    let outcome: Result<(), Error> = async {
        agent.set_up_pool(spec).await?;
        for i in &spec.instances {
            let row = |lease: String, tap: &str, mac: &str, seed_address: &str| InstanceRow {
                instance: i.instance_id.clone(),
                policy: format!("{:?}", i.policy).to_lowercase(),
                lease,
                tap: tap.into(),
                mac: mac.into(),
                seed_address: seed_address.into(),
            };
            let inst = match agent.create_instance(spec, i).await {
                Ok(inst) => inst,
                Err(e) => {
                    placement.push((i.instance_id.clone(), Err(e.code)));
                    rows.push(row(format!("{}: {}", e.code, e.message), "-", "-", "-"));
                    continue;
                }
            };
            created.push(i.instance_id.clone());
            let addr = inst.address.ok_or_else(|| {
                Error::internal(format!(
                    "instance {}: created without a lease",
                    i.instance_id
                ))
            })?;
            placement.push((i.instance_id.clone(), Ok(addr)));
            let nics: InstanceNics = agent
                .client
                .get(&format!("/v1/instances/{}/nics", segment(&i.instance_id)))
                .await?;
            let nic = nics.nics.first().filter(|_| nics.realised).ok_or_else(|| {
                Error::internal(format!(
                    "instance {}: not realised on the host; {}",
                    i.instance_id,
                    agent.log_tail()
                ))
            })?;
            let seed_file = agent.seeds.join(&i.instance_id).join("network-config");
            let network_config = std::fs::read_to_string(&seed_file)
                .map_err(|e| Error::internal(format!("{}: {e}", seed_file.display())))?;
            let mac: MacAddr = nic.mac.parse()?;
            let ns = sb
                .add_netns(&format!("g{}", guests.len()))
                .map_err(|e| Error::unavailable(e.to_string()))?;
            for k in ["all", "default"] {
                tk::sysctl(&ns, &format!("net/ipv6/conf/{k}/accept_dad"), "0")
                    .map_err(|e| Error::unavailable(e.to_string()))?;
            }
            relays.push(
                Relay::start(&host, &nic.tap, &ns, "eth0")
                    .map_err(|e| Error::unavailable(e.to_string()))?,
            );
            let net = sim_guest::configure(&ns, "eth0", mac, Some(&network_config))
                .map_err(internal("simulated guest"))?;
            rows.push(row(
                addr.to_string(),
                &nic.tap,
                &nic.mac,
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
        let pool: vmnet_model::pool::Pool = agent
            .client
            .get(&format!("/v1/pools/{}", segment(&spec.pool.pool_id)))
            .await?;
        range = pool.range;
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    }
    .await;
    let mut checks = Vec::new();
    if let (Ok(()), Some(r)) = (&outcome, &range) {
        let (gs, pl) = (&guests, &placement);
        let rt = tokio::runtime::Handle::current();
        let agent = &agent;
        checks = tokio::task::block_in_place(|| {
            let mut all = checks::run(gs, r, pl);
            all.extend(checks::host_reach(gs, &host, bridge.as_str(), r.gateway));
            let before = std::cell::Cell::new(0);
            let mut hold_audit = || {
                before.set(
                    rt.block_on(agent.pool_status())
                        .map_err(|e| e.message)?
                        .drift_repairs,
                );
                agent.signal(nix::sys::signal::Signal::SIGSTOP)
            };
            let mut audit = || {
                agent.signal(nix::sys::signal::Signal::SIGCONT)?;
                Ok(rt
                    .block_on(agent.wait_repair(before.get(), AUDIT_WAIT))
                    .is_some())
            };
            all.extend(checks::gap(
                gs,
                &mut checks::GapHost {
                    ns: &host,
                    bridge: bridge.as_str(),
                    hold_audit: &mut hold_audit,
                    audit: &mut audit,
                },
            ));
            all
        });
    }
    drop(relays);
    // Deleting the instances through the API removes their taps, rules and seeds.
    for id in &created {
        if let Err(e) = agent.delete_instance(id).await {
            checks.push(checks::check(
                format!("teardown: delete {id}"),
                "deleted",
                e.to_string(),
            ));
        }
    }
    if outcome.is_ok() && range.is_some() {
        checks.push(checks::left_behind(&host));
    }
    drop(agent);
    drop(sb);
    outcome?;
    Ok(PoolReport {
        sandbox: name.to_owned(),
        instances: rows,
        checks,
    })
}

/// How long the gap check waits for the agent's audit (one 5 s period and some slack).
const AUDIT_WAIT: Duration = Duration::from_secs(6);

fn print(r: &PoolReport) {
    print!("{}", render(r));
}

/// The two tables (instances, checks) in the namespace-mode layout, and the summary line.
fn render(r: &PoolReport) -> String {
    use vmnet_agent::table::render as render_table;
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

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"mode": "pool", "pool": {"pool_id": "pool-1", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1"},
        "host": {"host_id": "h1", "vcpus": 8, "memory_mib": 8192},
        "instances": [{"instance_id": "web-1"}, {"instance_id": "web-2", "policy": "private"}]}"#;

    #[test]
    fn pool_specs_are_checked_before_anything_is_built() {
        assert_eq!(PoolSpec::parse("f", GOOD).unwrap().instances.len(), 2);
        let with = |from: &str, to: &str| GOOD.replacen(from, to, 1);
        let cases: Vec<(String, &str)> = vec![
            ("[]".into(), "must be a JSON object"),
            (r#"{"mode": "pool", "#.into(), "not valid JSON"),
            (
                with(r#""mode": "pool""#, r#""mode": "Pool""#),
                "mode \"Pool\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "bc0","#),
                "bridge \"bc0\"",
            ),
            (
                with(
                    r#""mode": "pool","#,
                    r#""mode": "pool", "bridge": "uplink","#,
                ),
                "bridge \"uplink\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "lo","#),
                "bridge \"lo\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "a b","#),
                "bridge:",
            ),
            (
                with(
                    r#"[{"instance_id": "web-1"}, {"instance_id": "web-2", "policy": "private"}]"#,
                    "[]",
                ),
                "instances: at least one",
            ),
            (
                with(r#""web-2""#, r#""web-1""#),
                "instances[1].instance_id \"web-1\" appears twice",
            ),
            (
                with(r#""web-2""#, r#""web-2\nnetwork: {config: disabled}""#),
                "instances[1].instance_id",
            ),
            (
                with(r#""web-2""#, r#""web-2\"; flush ruleset; #""#),
                "instances[1].instance_id",
            ),
            (with(r#""web-1""#, r#""""#), "instances[0].instance_id"),
            (
                with(r#""web-1"}"#, r#""web-1", "colour": "red"}"#),
                "unknown field",
            ),
            (with("10.0.0.0/29", "10.0.0.5/29"), "pool pool-1"),
            (
                with(
                    r#""10.0.0.0/29", "gateway": "10.0.0.1""#,
                    r#""203.0.113.8/29", "gateway": "203.0.113.9""#,
                ),
                "overlaps the sandbox uplink",
            ),
            (
                with(
                    r#""10.0.0.0/29", "gateway": "10.0.0.1""#,
                    r#""198.51.100.0/25", "gateway": "198.51.100.1""#,
                ),
                "overlaps the fake internet",
            ),
            (
                with(r#""host_id": "h1""#, r#""host_id": "h 1""#),
                "host.host_id",
            ),
            (with(r#""vcpus": 8"#, r#""vcpus": 0"#), "host: vcpus"),
        ];
        for (text, want) in cases {
            let e = PoolSpec::parse("f.json", &text).unwrap_err();
            assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{text}");
            assert!(e.message.starts_with("pool spec f.json: "), "{}", e.message);
            assert!(e.message.contains(want), "{text}: {}", e.message);
        }
    }

    #[test]
    fn a_sandbox_name_is_claimed_once() {
        let root = tempfile::tempdir().unwrap();
        let name = format!("vc{:06x}", std::process::id() & 0xff_ffff);
        let first = crate::state::claim(root.path(), &name).unwrap();
        assert!(first.dir.is_dir());
        let again = crate::state::claim(root.path(), &name).unwrap_err();
        assert_eq!(again.code, vmnet_model::ErrorCode::Conflict);
    }

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
