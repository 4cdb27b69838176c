//! What `GET /v1/vms/{id}/activity` and `GET /v1/activity` report (spec: "Packet activity and
//! wake"), and the pure rule that computes it. A leaf module.
//!
//! # Design
//! The kernel records per VM user id the time of the last TCP packet the guest received from
//! the host side (`vmnet_kernel::activity`); those times survive agent restarts (pinned maps).
//! A VM's **baseline** is when this agent started or, for a VM this agent created (or gave a new
//! user id), when it did. A VM's idle time counts from the later of its last activity and its
//! baseline, so a restarted agent never reports a VM idle for longer than it has been running,
//! and a new VM is not idle for longer than it has existed: a restart or a create can delay a
//! sleep decision, never bring one forward.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One VM's activity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmActivity {
    /// The VM id.
    pub id: String,
    /// The VM user id.
    pub user_id: u32,
    /// When the guest last received TCP from the host side (RFC 3339, UTC, milliseconds);
    /// `null` when never since the host booted or the VM was created.
    pub last_activity: Option<String>,
    /// `last_activity` in milliseconds since the Unix epoch.
    pub last_activity_unix_ms: Option<i64>,
    /// The later of the agent's start and the VM's creation by this agent (RFC 3339): idle
    /// time never counts from before it.
    pub baseline: String,
    /// `baseline` in milliseconds since the Unix epoch.
    pub baseline_unix_ms: i64,
    /// Whole seconds since the later of `last_activity` and `baseline`.
    pub idle_secs: u64,
    /// Wake on packet's counters for the VM (`GET /v1/vms/{id}/activity` only, when wake on
    /// packet is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake: Option<crate::wake::hold::Counters>,
}

/// `GET /v1/activity`: every VM (or those idle at least `idle_secs`), ordered by id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivityList {
    /// The agent's start (RFC 3339).
    pub baseline: String,
    /// `baseline` in milliseconds since the Unix epoch.
    pub baseline_unix_ms: i64,
    /// The filter applied: VMs idle at least this many seconds (`null`: all VMs).
    pub idle_secs: Option<u64>,
    /// The VMs.
    pub vms: Vec<VmActivity>,
}

/// `t` in milliseconds since the Unix epoch.
#[must_use]
pub fn unix_ms(t: SystemTime) -> i64 {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `t` as RFC 3339 in UTC with milliseconds (`2026-12-02T01:23:45.678Z`).
#[must_use]
pub fn rfc3339(t: SystemTime) -> String {
    // Before the epoch cannot happen for a recorded time; clamp rather than panic.
    let t = t.max(UNIX_EPOCH);
    humantime::format_rfc3339_millis(t).to_string()
}

/// Seconds `last` (or the baseline, whichever is later) lies before `now`.
#[must_use]
pub fn idle_secs(last: Option<SystemTime>, baseline: SystemTime, now: SystemTime) -> u64 {
    let from = last.map_or(baseline, |l| l.max(baseline));
    now.duration_since(from).unwrap_or(Duration::ZERO).as_secs()
}

/// The report of one VM.
#[must_use]
pub fn view(
    id: &str,
    user_id: u32,
    last: Option<SystemTime>,
    baseline: SystemTime,
    now: SystemTime,
) -> VmActivity {
    VmActivity {
        id: id.to_owned(),
        user_id,
        last_activity: last.map(rfc3339),
        last_activity_unix_ms: last.map(unix_ms),
        baseline: rfc3339(baseline),
        baseline_unix_ms: unix_ms(baseline),
        idle_secs: idle_secs(last, baseline, now),
        wake: None,
    }
}

/// Parses the query of `GET /v1/activity`: only `idle_secs`, a whole number of seconds. Names
/// and values are decoded as `application/x-www-form-urlencoded` (`%31` is `1`, `+` a space).
///
/// # Errors
/// A sentence naming the parameter (`INVALID_INPUT` at the edge).
pub fn parse_query(query: Option<&str>) -> Result<Option<u64>, String> {
    let mut idle = None;
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "idle_secs" => {
                if idle.is_some() {
                    return Err("query parameter idle_secs: given more than once".into());
                }
                let n = v
                    .parse::<u64>()
                    .ok()
                    .filter(|_| !v.starts_with('+'))
                    .ok_or_else(|| {
                        format!("query parameter idle_secs: {v:?} is not a whole number of seconds (0 or more)")
                    })?;
                idle = Some(n);
            }
            other => {
                return Err(format!(
                    "query parameter {other:?} is unknown (only idle_secs)"
                ));
            }
        }
    }
    Ok(idle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    #[test]
    fn idle_counts_from_the_later_of_activity_and_baseline() {
        // Active after the agent started: from the activity.
        assert_eq!(idle_secs(Some(at(150)), at(100), at(200)), 50);
        // Active before the agent (re)started: from the baseline, never longer.
        assert_eq!(idle_secs(Some(at(10)), at(100), at(200)), 100);
        // Never active: from the baseline.
        assert_eq!(idle_secs(None, at(100), at(200)), 100);
        // A clock stepped back: zero, not a panic.
        assert_eq!(idle_secs(Some(at(300)), at(100), at(200)), 0);
    }

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_174_144_777);
        assert_eq!(rfc3339(t), "2026-12-02T01:15:44.777Z");
        let v = view("web", 7, None, at(0), at(5));
        assert_eq!(v.last_activity, None);
        assert_eq!(v.baseline, "1970-01-01T00:00:00.000Z");
        assert_eq!(v.idle_secs, 5);
    }

    #[test]
    fn the_query_takes_idle_secs_only() {
        assert_eq!(parse_query(None), Ok(None));
        assert_eq!(parse_query(Some("")), Ok(None));
        assert_eq!(parse_query(Some("idle_secs=0")), Ok(Some(0)));
        assert_eq!(parse_query(Some("idle_secs=600")), Ok(Some(600)));
        // Percent-decoded, names too.
        assert_eq!(parse_query(Some("idle_secs=%31")), Ok(Some(1)));
        assert_eq!(parse_query(Some("idle%5Fsecs=%36%30")), Ok(Some(60)));
        for bad in [
            "idle_secs=-1",
            "idle_secs=",
            "idle_secs=1.5",
            "idle_secs=+3",
            "idle_secs=%2B3",
            "idle_secs=%20",
            "idle_secs=%FF",
            "idle_secs=x",
        ] {
            let e = parse_query(Some(bad)).expect_err(bad);
            assert!(e.contains("idle_secs"), "{e}");
        }
        assert!(
            parse_query(Some("idle_secs=1&idle_secs=2"))
                .expect_err("twice")
                .contains("idle_secs")
        );
        assert!(
            parse_query(Some("idle=5"))
                .expect_err("unknown")
                .contains("\"idle\"")
        );
    }
}
