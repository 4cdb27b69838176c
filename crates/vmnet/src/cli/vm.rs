//! Client commands talking to the agent's API: `vmnet vm …`, `vmnet status`, `vmnet apply FILE`.
//!
//! All of them speak HTTP over the agent's unix socket (`--socket`, default
//! `/run/vmnet/vmnet.sock`) through [`vmnet_agent::client::Client`]. An API error is returned as
//! the [`vmnet_model::Error`] the agent sent, so `main` prints `error: CODE: message` and exits
//! with the code's documented exit status.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Subcommand;
use vmnet_agent::api::types::{ActivityList, AgentStatus, ApplyReport, VmActivity, VmView};
use vmnet_agent::apply::apply_host_spec;
use vmnet_agent::client::{Client, segment};
use vmnet_agent::hostspec::HostSpec;
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;

use super::io::{print_json, read_file};
use super::vm_text::{limits_text, public_text};
use crate::{Global, Output};

/// `vmnet vm …`
#[derive(Debug, Subcommand)]
pub enum VmCmd {
    /// Create or replace a VM's network config from a JSON file (`-` for stdin) and apply it.
    Put {
        /// The VM config file (JSON, the body of `PUT /v1/vms/{id}`); `-` reads it from
        /// standard input (`vmnet vm put - <<'EOF'`).
        file: PathBuf,
    },
    /// Show a VM: its config and status (names, transit /30, guest, routes, last error).
    Get {
        /// The VM id.
        id: String,
    },
    /// List the VMs the agent holds.
    List,
    /// Delete a VM: remove everything it had in the kernel.
    Delete {
        /// The VM id.
        id: String,
    },
    /// Show packet activity: when each VM's guest last received TCP from the host side, and
    /// how long it has been idle (never counted from before the agent started).
    Activity {
        /// One VM id; without it, every VM.
        id: Option<String>,
        /// Only VMs idle at least this many seconds (without ID).
        #[arg(long, value_name = "SECS", conflicts_with = "id")]
        idle_secs: Option<u64>,
    },
}

// Its doc is the command's help summary, word for word `ClientCmd::Apply`'s: `vmnet` defers
// the command's arguments, and then this summary is the one shown.
/// Apply a host spec (pools, instances and VMs in one file) declaratively.
#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// The host spec file (JSON: pools, hosts, instances, vms), `-` for stdin.
    pub file: PathBuf,
    /// Also delete the VMs the agent holds that the file does not list (VMs only; pools, hosts
    /// and instances are never deleted by apply).
    #[arg(long)]
    pub prune: bool,
}

/// The largest VM config file read: the largest body the agent accepts.
const VM_FILE_LIMIT: u64 = vmnet_agent::api::error::BODY_LIMIT_BYTES as u64;

/// The largest host spec read (it is sent to the agent one object at a time).
const SPEC_FILE_LIMIT: u64 = 16 * 1024 * 1024;

/// Runs `vmnet vm …`.
pub fn vm(g: &Global, c: VmCmd) -> Result<(), Error> {
    let client = Client::new(&g.socket);
    match c {
        VmCmd::Put { file } => {
            let (name, bytes) = read_file(&file, VM_FILE_LIMIT)?;
            // Validate locally first for a message naming the file; the agent validates again.
            let cfg = parse_vm_config(&bytes)
                .map_err(|e| Error::invalid(format!("{name}: {}", e.message())))?;
            let view: VmView =
                client.put_blocking(&format!("/v1/vms/{}", segment(&cfg.id)), &cfg)?;
            show_vms(g.output, std::slice::from_ref(&view), true)
        }
        VmCmd::Get { id } => {
            valid_id(&id)?;
            let view: VmView = client.get_blocking(&format!("/v1/vms/{}", segment(&id)))?;
            show_vms(g.output, std::slice::from_ref(&view), true)
        }
        VmCmd::List => {
            let views: Vec<VmView> = client.get_blocking("/v1/vms")?;
            show_vms(g.output, &views, false)
        }
        VmCmd::Activity { id, idle_secs } => activity(g, &client, id, idle_secs),
        VmCmd::Delete { id } => {
            valid_id(&id)?;
            let view: VmView = client.delete_blocking(&format!("/v1/vms/{}", segment(&id)))?;
            match g.output {
                Output::Json => print_json(&view),
                Output::Table => {
                    vmnet_cli::outln!(
                        "deleted vm {} (netns {})",
                        view.config.id,
                        view.status.netns
                    )?;
                    Ok(())
                }
            }
        }
    }
}

/// An empty id would address the collection (`/v1/vms/`), which has no such route.
/// A VM id given on the command line, checked by the rule the agent applies (so that an id no
/// request line can carry is refused naming the id's own limit).
fn valid_id(id: &str) -> Result<(), Error> {
    vmnet_model::vm::validate_vm_id(id).map_err(|e| Error::invalid(e.message()))
}

fn dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

fn show_vms(out: Output, views: &[VmView], detail: bool) -> Result<(), Error> {
    if out == Output::Json {
        return if detail && views.len() == 1 {
            print_json(&views[0])
        } else {
            print_json(&views)
        };
    }
    let header = [
        "VM", "USER", "STATE", "NETNS", "VETH", "TRANSIT", "MESH", "PUBLIC", "LIMITS", "ROUTES",
    ];
    let mut rows = Vec::new();
    for v in views {
        let s = &v.status;
        let routes: Vec<String> = v
            .config
            .network
            .routes
            .iter()
            .map(|r| format!("{} via {}", r.destination, r.via))
            .collect();
        rows.push(vec![
            v.config.id.clone(),
            v.config.user_id.to_string(),
            s.state.as_str().to_owned(),
            s.netns.clone(),
            dash(s.veth_host.as_ref()),
            dash(s.transit.as_ref()),
            dash(v.config.mesh_ipv6),
            public_text(v),
            limits_text(v),
            if routes.is_empty() {
                "-".to_owned()
            } else {
                routes.join(", ")
            },
        ]);
    }
    // One write for the whole answer, not one per line (stdout is line-buffered): a client
    // called once per VM pays for every system call.
    let mut o = vmnet_agent::table::render(&header, &rows);
    if detail {
        for v in views {
            let s = &v.status;
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "tap:          {} (owner uid {})",
                s.tap,
                dash(s.tap_owner)
            );
            let _ = writeln!(
                o,
                "guest:        {} gateway {} mac {} mtu {}",
                s.guest_ipv4, s.gateway_ipv4, s.guest_mac, s.mtu
            );
            if let Some(peer) = &s.veth_ns {
                let _ = writeln!(o, "veth in ns:   {peer}");
            }
            let applied: Vec<String> = s
                .applied_routes
                .iter()
                .map(|r| format!("{} via {}", r.destination, r.via))
                .collect();
            let _ = writeln!(
                o,
                "applied:      {}",
                if applied.is_empty() {
                    "-".to_owned()
                } else {
                    applied.join(", ")
                }
            );
            let _ = writeln!(
                o,
                "public:       {} (applied {} {}, reached {})",
                public_text(v),
                dash(s.applied_public_ipv4.as_ref()),
                dash(s.applied_public_ipv6.as_ref()),
                s.public_neighbors
            );
            for l in &s.limits {
                let (rate, state) = if l.limit_mibps == 0 {
                    ("unlimited".to_owned(), "")
                } else {
                    (
                        format!("{} MiB/s", l.limit_mibps),
                        if l.applied { "" } else { " (not applied)" },
                    )
                };
                // The class and direction as the API spells them (`private`, `download`).
                let class = format!("{:?}", l.class).to_lowercase();
                let direction = format!("{:?}", l.direction).to_lowercase();
                let _ = writeln!(
                    o,
                    "limit:        {class} {direction} {rate}{state}{}",
                    match (l.bytes, l.packets, l.drops) {
                        (Some(b), Some(p), Some(d)) =>
                            format!(", {b} bytes, {p} packets, {d} drops"),
                        _ => String::new(),
                    }
                );
            }
            let _ = writeln!(
                o,
                "firewall:     {} ({} repairs)",
                firewall_text(v),
                s.firewall_repairs
            );
            let _ = writeln!(
                o,
                "metadata:     {}",
                metadata_text(v.config.metadata.as_ref())
            );
            if let Some(d) = &s.guard_drops {
                let _ = writeln!(o, "guard drops:  {}", super::guard::drops_text(d));
            }
            let _ = writeln!(o, "last error:   {}", dash(s.last_error.as_ref()));
        }
    }
    vmnet_cli::out(format_args!("{o}"))?;
    Ok(())
}

/// The metadata service version the VM's guest talks to: `v1`, `v2`, or `host default` when
/// the config names none (`vmnet serve --metadata-version`).
fn metadata_text(m: Option<&vmnet_model::vm::metadata::MetadataConfig>) -> String {
    m.and_then(|m| m.version).map_or_else(
        || "host default (serve --metadata-version)".to_owned(),
        |v| v.to_string(),
    )
}

/// `off`, or `on: N inbound, M outbound rules`, `(not filtering)` while not in force.
fn firewall_text(v: &VmView) -> String {
    match &v.config.firewall {
        Some(f) if f.enabled => format!(
            "on: {} inbound, {} outbound rules{}",
            f.inbound.len(),
            f.outbound.len(),
            if v.status.firewall_filtering {
                ""
            } else {
                " (not filtering)"
            }
        ),
        Some(f) => format!("off ({} rules kept)", f.inbound.len() + f.outbound.len()),
        None => "off".to_owned(),
    }
}

fn print_table(header: &[&str], rows: &[Vec<String>]) -> Result<(), Error> {
    vmnet_cli::out(format_args!("{}", vmnet_agent::table::render(header, rows)))
}

/// How long ago `unix_ms` was, e.g. `3.2 s`.
fn ago(unix_ms: i64) -> String {
    let now = vmnet_agent::status::now_ms();
    let ms = now.saturating_sub(unix_ms).max(0);
    let secs = ms / 1000;
    let tenths = (ms % 1000) / 100;
    format!("{secs}.{tenths} s")
}

/// Runs `vmnet status`.
pub fn status(g: &Global) -> Result<(), Error> {
    let st: AgentStatus = Client::new(&g.socket).get_blocking("/v1/status")?;
    if g.output == Output::Json {
        return print_json(&st);
    }
    let r = &st.reconcile;
    let mut rows = vec![
        vec![
            "agent".to_owned(),
            format!("vmnet {} (prefix {})", st.version, st.name_prefix),
        ],
        vec![
            "vms".to_owned(),
            format!(
                "{} desired, {} applied, {} failed",
                st.vms.desired, st.vms.applied, st.vms.failed
            ),
        ],
        vec!["reconcile passes".to_owned(), r.passes.to_string()],
        vec![
            "interval".to_owned(),
            format!("{} s", st.reconcile_interval_secs),
        ],
        vec![
            "last reconcile".to_owned(),
            match (r.last_finished_at_unix_ms, r.last_ok) {
                (Some(t), Some(ok)) => format!(
                    "{}, {} ago, took {} ms",
                    if ok { "ok" } else { "failed" },
                    ago(t),
                    dash(r.last_duration_ms)
                ),
                _ => "never".to_owned(),
            },
        ],
        vec![
            "orphans removed".to_owned(),
            r.orphans_removed_total.to_string(),
        ],
        vec![
            "drift repaired".to_owned(),
            format!(
                "{} ({} by passes, {} on notifications)",
                r.drift_repairs_total, r.pass_repairs_total, r.notifications.repairs_total
            ),
        ],
        vec![
            "kernel notifications".to_owned(),
            notifications_line(&r.notifications),
        ],
        vec![
            "firewall audit".to_owned(),
            format!(
                "every {} s, {} audits, {} tables repaired",
                st.firewall.audit_period_secs, st.firewall.audits, st.firewall.repairs_total
            ),
        ],
    ];
    rows.push(vec![
        "guest guard".to_owned(),
        super::guard::guest_guard_line(st.guest_guard.as_ref()),
    ]);
    if let Some(p) = &st.pool {
        rows.extend(pool_rows(p));
    }
    for p in st.provider_pools.iter().flatten() {
        rows.push(vec![
            format!("provider pool {}", p.pool_id),
            provider_line(p),
        ]);
    }
    print_table(&["STATUS", "VALUE"], &rows)?;
    for e in &r.last_errors {
        vmnet_cli::outln!("error: {e}")?;
    }
    if let Some(p) = &st.pool {
        for e in p.last_errors.iter().chain(&p.last_audit_error) {
            vmnet_cli::outln!("pool error: {e}")?;
        }
    }
    Ok(())
}

/// One provider pool in `vmnet status`: `hetzner-cloud ok, 3 machines, 20 requests, polled 4 s
/// ago` or `… auth_failed: GET … answered 401: the credentials were refused`.
fn provider_line(p: &vmnet_agent::api::types::ProviderPoolStatus) -> String {
    let state = serde_json::to_value(p.state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let mut line = format!(
        "{} {state}, {} machines, {} requests, polled {}",
        p.provider,
        p.machines,
        p.last_requests,
        p.last_poll_at_unix_ms
            .map_or_else(|| "never".to_owned(), |t| format!("{} ago", ago(t)))
    );
    if let Some(e) = &p.last_error {
        line.push_str(": ");
        line.push_str(e);
    }
    line
}

/// The pool-mode rows of `vmnet status`.
fn pool_rows(p: &vmnet_agent::api::types::PoolStatus) -> Vec<Vec<String>> {
    let tables = if p.tables.is_empty() {
        "none".to_owned()
    } else {
        p.tables
            .iter()
            .map(|t| format!("{t} ({} rules)", p.rules.get(t).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let elements: u64 = p.elements.values().sum();
    vec![
        vec![
            "pool host".to_owned(),
            format!("{} on bridge {}", p.host_id, p.bridge),
        ],
        vec![
            "pool instances".to_owned(),
            format!("{} realised, {} taps", p.instances, p.taps),
        ],
        vec!["pool tables".to_owned(), tables],
        vec!["pool set elements".to_owned(), elements.to_string()],
        vec![
            "pool audits".to_owned(),
            format!(
                "{}, last {}, {} drift repairs",
                p.audits,
                p.last_audit_at_unix_ms
                    .map_or_else(|| "never".to_owned(), |t| format!("{} ago", ago(t))),
                p.drift_repairs
            ),
        ],
        vec!["pool seeds".to_owned(), p.seed_dir.clone()],
        vec!["pool tap guard".to_owned(), guard_line(p.guard.as_ref())],
    ]
}

/// `off`, or the taps guarded and the non-zero drop counters.
fn guard_line(g: Option<&vmnet_agent::api::types::GuardStatus>) -> String {
    let Some(g) = g else {
        return "off (--no-tap-guard)".to_owned();
    };
    let drops: Vec<String> = g
        .drops
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let drops = if drops.is_empty() {
        "none".to_owned()
    } else {
        drops.join(", ")
    };
    match &g.error {
        Some(e) => format!("{} taps; drops unreadable: {e}", g.taps),
        None => format!("{} taps; drops: {drops}", g.taps),
    }
}

/// Runs `vmnet apply FILE`.
pub async fn apply(g: &Global, args: ApplyArgs) -> Result<(), Error> {
    let (name, bytes) = read_file(&args.file, SPEC_FILE_LIMIT)?;
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::invalid(format!("host spec {name}: not UTF-8")))?;
    let spec = HostSpec::parse(&name, &text)?;
    let report: ApplyReport = apply_host_spec(&Client::new(&g.socket), &spec, args.prune).await?;
    if g.output == Output::Json {
        return print_json(&report);
    }
    let header = ["KIND", "ID", "RESULT"];
    let mut rows = Vec::new();
    for item in &report.items {
        rows.push(vec![
            item.kind.clone(),
            item.id.clone(),
            item.result.clone(),
        ]);
    }
    print_table(&header, &rows)?;
    Ok(())
}

fn activity(
    g: &Global,
    client: &Client,
    id: Option<String>,
    idle_secs: Option<u64>,
) -> Result<(), Error> {
    let (baseline, vms) = match id {
        Some(id) => {
            valid_id(&id)?;
            let one: VmActivity =
                client.get_blocking(&format!("/v1/vms/{}/activity", segment(&id)))?;
            if g.output == Output::Json {
                return print_json(&one);
            }
            (one.baseline.clone(), vec![one])
        }
        None => {
            let path = idle_secs.map_or_else(
                || "/v1/activity".to_owned(),
                |n| format!("/v1/activity?idle_secs={n}"),
            );
            let list: ActivityList = client.get_blocking(&path)?;
            if g.output == Output::Json {
                return print_json(&list);
            }
            (list.baseline, list.vms)
        }
    };
    let rows: Vec<Vec<String>> = vms
        .iter()
        .map(|v| {
            vec![
                v.id.clone(),
                v.user_id.to_string(),
                dash(v.last_activity.as_ref()),
                v.idle_secs.to_string(),
            ]
        })
        .collect();
    print_table(&["VM", "USER", "LAST ACTIVITY", "IDLE SECS"], &rows)?;
    vmnet_cli::outln!()?;
    vmnet_cli::outln!("baseline (agent start): {baseline}")?;
    Ok(())
}

/// The `kernel notifications` row of `vmnet status`.
fn notifications_line(n: &vmnet_agent::status::NotificationStatus) -> String {
    if !n.on {
        return "off (drift waits for the next pass)".to_owned();
    }
    let ms = |us: Option<u64>| {
        us.map_or_else(|| "-".to_owned(), |u| format!("{:.1}", u as f64 / 1000.0))
    };
    format!(
        "on, {} checks, {} repairs, {} back-offs, {} lost; change to repair {} ms (max {} ms)",
        n.checks_total,
        n.repairs_total,
        n.backoffs_total,
        n.lost_total,
        ms(n.last_change_to_repair_us),
        ms(n.max_change_to_repair_us)
    )
}

#[cfg(test)]
mod tests {
    use vmnet_model::vm::metadata::{MetadataConfig, MetadataVersion};

    use super::metadata_text;

    #[test]
    fn the_metadata_version_is_shown() {
        let v1 = MetadataConfig {
            version: Some(MetadataVersion::V1),
        };
        assert_eq!(metadata_text(Some(&v1)), "v1");
        let v2 = MetadataConfig {
            version: Some(MetadataVersion::V2),
        };
        assert_eq!(metadata_text(Some(&v2)), "v2");
        let none = MetadataConfig { version: None };
        assert!(metadata_text(Some(&none)).starts_with("host default"));
        assert!(metadata_text(None).starts_with("host default"));
    }
}
