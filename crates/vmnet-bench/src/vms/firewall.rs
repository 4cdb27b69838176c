//! `vmnet-lab bench vms --firewall`: every VM gets a firewall of [`PREFIXES`] prefix entries, and at
//! each N one VM's firewall is changed to another 50-prefix firewall and back
//! ([`NsDriver::apply_table`], as a PUT changing only the firewall does: the VM's two rule
//! chains in one netlink batch when the table is known to be of the same shape, else the table replaced
//! in one transaction; the line counts which), and one firewall audit pass over every VM is timed
//! ([`NsDriver::audit_table`] each: a listing and a content comparison, nothing rewritten).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vmnet_kernel::ns::NsDriver;
use vmnet_model::Error;
use vmnet_plan::ns::{NsSettings, plan_vm};

/// Prefix entries per firewall (the most a firewall may hold).
pub const PREFIXES: usize = 50;
/// How many firewall changes are timed per N.
pub const CHANGE_ROUNDS: u32 = 20;

/// The variant of [`firewall`] that is variant 0 with one prefix replaced by another.
pub const ONE_PREFIX_CHANGED: u32 = u32::MAX;

/// A 50-prefix firewall; `variant` shifts its prefixes and ports (0 and 1 differ everywhere;
/// see also [`ONE_PREFIX_CHANGED`]).
#[must_use]
pub fn firewall(variant: u32) -> Value {
    if variant == ONE_PREFIX_CHANGED {
        let mut v = firewall(0);
        v["inbound"][0]["prefixes"][0] = json!("10.200.0.0/24");
        return v;
    }
    let v4 = |i: u32| format!("10.{}.{}.0/24", variant, i);
    let v6 = |i: u32| format!("2001:db8:{variant:x}:{i:x}::/64");
    let port = 22 + variant;
    json!({"enabled": true,
        "inbound": [
            {"protocol": "tcp", "ports": port.to_string(), "prefixes": (0..10).map(v4).chain((0..10).map(v6)).collect::<Vec<_>>()},
            {"protocol": "tcp", "ports": format!("{}-{}", 8000 + variant, 8100 + variant), "prefixes": (10..15).map(v4).chain((10..15).map(v6)).collect::<Vec<_>>()},
            {"protocol": "udp", "ports": "53", "prefixes": (15..20).map(v4).collect::<Vec<_>>()},
            {"protocol": "icmp", "prefixes": (20..25).map(v6).collect::<Vec<_>>()}],
        "outbound": [
            {"protocol": "any", "prefixes": (25..30).map(v4).chain((25..30).map(v6)).collect::<Vec<_>>()}]})
}

/// The firewall changes timed at one N.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// The latency of each change of every prefix and port (variant 0 to 1 and back).
    pub times: Vec<Duration>,
    /// The latency of each change of one prefix (variant 0 to [`ONE_PREFIX_CHANGED`] and back).
    pub one: Vec<Duration>,
    /// How many of either went in as one rule batch (the rest replaced the table).
    pub batched: usize,
}

/// Changes VM `uid`'s firewall (set up with variant 0) to variant 1 and back [`CHANGE_ROUNDS`]
/// times each, then to [`ONE_PREFIX_CHANGED`] and back as often; the latencies of every change
/// and how many were rule batches.
///
/// # Errors
/// `INTERNAL` when an apply fails.
pub async fn bench_change(
    driver: &dyn NsDriver,
    settings: &NsSettings,
    uid: u32,
    config: impl Fn(u32) -> Result<vmnet_model::vm::VmConfig, Error>,
) -> Result<Changes, Error> {
    let a = plan_vm(&config(0)?, settings)?;
    let b = plan_vm(&config(1)?, settings)?;
    let one = plan_vm(&config(ONE_PREFIX_CHANGED)?, settings)?;
    let mut out = Changes::default();
    for round in 0..2 * CHANGE_ROUNDS {
        let other = if round < CHANGE_ROUNDS { &b } else { &one };
        for plan in [other, &a] {
            let t = Instant::now();
            let changes = driver
                .apply_table(plan)
                .await
                .map_err(|e| Error::internal(format!("firewall change vm {uid}: {e}")))?;
            let took = t.elapsed();
            if round < CHANGE_ROUNDS {
                out.times.push(took);
            } else {
                out.one.push(took);
            }
            if format!("{changes:?}").contains("its rules, in one batch") {
                out.batched += 1;
            }
        }
    }
    Ok(out)
}

/// Two audit passes over VMs `1..=n` (plans made beforehand, as the agent's are per VM): the
/// wall time of the first (each table listed and compared: none was read back since it was
/// made) and of the second (the steady state of an unchanged host), and how many tables either rewrote (none
/// must be).
///
/// # Errors
/// `INTERNAL` when an audit fails.
pub async fn bench_audit(
    driver: &dyn NsDriver,
    settings: &NsSettings,
    n: u32,
    config: impl Fn(u32) -> Result<vmnet_model::vm::VmConfig, Error>,
) -> Result<(Duration, Duration, usize), Error> {
    let plans = (1..=n)
        .map(|uid| Ok(plan_vm(&config(uid)?, settings)?))
        .collect::<Result<Vec<_>, Error>>()?;
    let mut rewritten = 0;
    let mut pass = async || -> Result<Duration, Error> {
        let t = Instant::now();
        for p in &plans {
            if driver
                .audit_table(p)
                .await
                .map_err(|e| Error::internal(format!("audit vm {}: {e}", p.user_id)))?
                .is_some()
            {
                rewritten += 1;
            }
        }
        Ok(t.elapsed())
    };
    let first = pass().await?;
    let steady = pass().await?;
    Ok((first, steady, rewritten))
}

/// The result lines of the firewall figures at N = `n`: the change latency, and the audit
/// passes of [`bench_audit`] (the share of a core is the steady pass's, once a minute).
#[must_use]
pub fn lines(
    n: u32,
    change: &Changes,
    (first, steady): (Duration, Duration),
    rewritten: usize,
) -> String {
    let c = super::stats(&change.times);
    let one = super::stats(&change.one);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let share = steady.as_secs_f64() / 60.0 * 100.0;
    format!(
        "50-prefix firewall change at N={n}: every prefix and port: median {:.2} ms (p99 {:.2}); one prefix: median {:.2} ms (p99 {:.2}); {} changes, {} as one rule batch; target <= 1 ms: {}\n\
         firewall audit pass over {n} VMs: first {:.1} ms (every table listed), then {:.1} ms ({:.3} ms per VM, {rewritten} tables rewritten), {share:.3} % of a core at once a minute (target < 1 %): {}\n",
        c.median,
        c.p99,
        one.median,
        one.p99,
        change.times.len() + change.one.len(),
        change.batched,
        if c.median <= 1.0 { "met" } else { "MISSED" },
        ms(first),
        ms(steady),
        ms(steady) / f64::from(n.max(1)),
        if share < 1.0 && rewritten == 0 {
            "met"
        } else {
            "MISSED"
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_firewalls_hold_50_prefixes_and_differ() {
        for v in [0, 1] {
            let mut cfg = json!({"id": "b", "user_id": 1, "tenant": 1, "mesh_ipv6": "fdaa:1::1"});
            cfg["firewall"] = firewall(v);
            let c = vmnet_model::vm::from_value(&cfg).unwrap();
            assert_eq!(c.firewall.unwrap().prefix_count(), PREFIXES);
        }
        assert_ne!(firewall(0), firewall(1));
    }
}
