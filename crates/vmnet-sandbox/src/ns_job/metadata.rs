//! The main job's metadata checks: real requests from each simulated guest to
//! 169.254.169.254 — its own document with a version-2 token (instance id and mesh address),
//! the version its config asks for without a token, and, with every other VM named in forged
//! headers, still its own document — and the process that answers them: the agent's worker,
//! read from `/proc/<pid>/status` (its user, no capability, `no_new_privs`, a seccomp filter).

use std::time::Duration;

use vmnet_model::vm::VmConfig;
use vmnet_model::vm::metadata::MetadataVersion;

use super::checks::CheckResult;
use crate::mmds::{get_request, get_with_token, request};

const TIMEOUT: Duration = Duration::from_secs(2);
const ID_PATH: &str = "/latest/meta-data/instance-id";

fn seen(r: Result<crate::mmds::MmdsReply, crate::SandboxError>) -> String {
    match r {
        Ok(r) if r.status == 200 => r.body,
        Ok(r) => format!("status {}", r.status),
        Err(e) => format!("error: {e}"),
    }
}

/// `Key:` of `/proc/<pid>/status`.
fn proc_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into())
}

/// Who serves the metadata service: the worker the agent reports, as the kernel sees it.
pub async fn worker(client: &vmnet_agent::client::Client) -> CheckResult {
    let st: Result<vmnet_agent::api::types::AgentStatus, _> = client.get("/v1/status").await;
    let w = match st.map(|s| s.worker) {
        Ok(Some(w)) => w,
        Ok(None) => {
            return CheckResult::new("host", "metadata worker", "a worker".into(), "none".into());
        }
        Err(e) => {
            return CheckResult::new("host", "metadata worker", "a worker".into(), e.to_string());
        }
    };
    let expected = format!(
        "user {} uid {} (not root), CapEff 0000000000000000, NoNewPrivs 1, Seccomp 2",
        w.user, w.uid
    );
    let seen = match w.pid {
        Some(pid) => match std::fs::read_to_string(format!("/proc/{pid}/status")) {
            Ok(s) => {
                let uid = proc_field(&s, "Uid");
                let euid = uid.split(' ').nth(1).unwrap_or("?").to_owned();
                format!(
                    "user {} uid {euid} ({}), CapEff {}, NoNewPrivs {}, Seccomp {}",
                    w.user,
                    if euid == "0" { "root" } else { "not root" },
                    proc_field(&s, "CapEff"),
                    proc_field(&s, "NoNewPrivs"),
                    proc_field(&s, "Seccomp"),
                )
            }
            Err(e) => format!("pid {pid}: {e}"),
        },
        None => "no worker running".into(),
    };
    CheckResult::new(
        "host",
        &format!(
            "metadata service runs as {} (worker pid {})",
            w.user,
            w.pid.map_or_else(|| "-".into(), |p| p.to_string())
        ),
        expected,
        seen,
    )
}

/// Runs the checks for every VM of `vms` (config and guest namespace, in the same order);
/// `default` is the host's version (the agent runs with its default, v2).
#[must_use]
pub fn run(vms: &[(VmConfig, String)], default: MetadataVersion) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for (cfg, ns) in vms {
        let vm = cfg.id.as_str();
        out.push(CheckResult::new(
            vm,
            "metadata own instance-id (v2 token)",
            vm.to_owned(),
            seen(get_with_token(ns, ID_PATH, TIMEOUT)),
        ));
        out.push(CheckResult::new(
            vm,
            "metadata own mesh-ipv6 (v2 token)",
            cfg.mesh_ipv6
                .map_or_else(|| "status 404".into(), |m| m.to_string()),
            seen(get_with_token(ns, "/latest/meta-data/mesh-ipv6", TIMEOUT)),
        ));
        let version = cfg.metadata.and_then(|m| m.version).unwrap_or(default);
        out.push(CheckResult::new(
            vm,
            &format!("metadata without token ({version})"),
            match version {
                MetadataVersion::V1 => vm.to_owned(),
                MetadataVersion::V2 => "status 401".into(),
            },
            seen(request(ns, None, &get_request(ID_PATH, &[]), TIMEOUT)),
        ));
        for (other, _) in vms.iter().filter(|(o, _)| o.id != cfg.id) {
            let mut forged = vec![format!("Host: {}", other.id)];
            if let Some(m) = other.mesh_ipv6 {
                forged.push(format!("X-Forwarded-For: {m}"));
            }
            if let Some(a) = other.public_ipv4 {
                forged.push(format!("X-Forwarded-For: {a}"));
            }
            let token = request(ns, None, &crate::mmds::token_request(60), TIMEOUT)
                .map(|r| format!("X-metadata-token: {}", r.body.trim()))
                .unwrap_or_default();
            forged.push(token);
            let h: Vec<&str> = forged.iter().map(String::as_str).collect();
            out.push(CheckResult::new(
                vm,
                &format!("metadata not {}'s (forged headers)", other.id),
                vm.to_owned(),
                seen(request(ns, None, &get_request(ID_PATH, &h), TIMEOUT)),
            ));
        }
    }
    out
}
