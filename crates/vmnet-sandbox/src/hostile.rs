//! Hostile-guest probes for the namespace-mode jobs: frames sent from a guest's `eth0` as a
//! guest root in its VM could send them (raw, any source), each looked for where it would
//! arrive (a capture on an interface, or the state it would change), beside honest frames that
//! must arrive. The guest guard's drop counters are the jobs' business.
//!
//! # Design
//! Every frame carries a unique marker. All frames are sent first; the honest ones are then
//! waited for (up to [`HONEST_WAIT`]), and only after they arrived (or the wait ran out) are
//! the spoofs looked for: a spoof sent beside an honest frame that arrived would have arrived
//! by then too.

use std::time::Duration;

use crate::probe::{Capture, send_frame};

/// How long an honest frame may take to arrive.
pub const HONEST_WAIT: Duration = Duration::from_secs(2);
/// How long a spoof is looked for after the honest frames arrived.
const SPOOF_WAIT: Duration = Duration::from_millis(200);

/// Reads the state a spoof would change: what changed, `None` when nothing did.
pub type StateRead = Box<dyn Fn() -> Option<String> + Send>;

/// Builds a case's frame, given its marker.
pub type FrameBuild = Box<dyn Fn(&[u8]) -> Vec<u8> + Send>;

/// Where a case is looked for.
pub enum Look {
    /// In the capture with this index.
    Capture(usize),
    /// In the state it would change: the closure reads it and returns what changed (`None`:
    /// nothing did).
    State(StateRead),
}

/// One frame to send.
pub struct Case {
    /// The check's name.
    pub name: String,
    /// Whether it must arrive (an honest frame) or must not (a spoof).
    pub arrives: bool,
    /// Where it is looked for.
    pub look: Look,
    /// The frame, given its marker.
    pub build: FrameBuild,
}

impl Case {
    /// An honest frame that must arrive in capture `at`.
    pub fn honest(
        name: &str,
        at: usize,
        build: impl Fn(&[u8]) -> Vec<u8> + Send + 'static,
    ) -> Self {
        Self {
            name: name.to_owned(),
            arrives: true,
            look: Look::Capture(at),
            build: Box::new(build),
        }
    }

    /// A spoof that must not arrive in capture `at`.
    pub fn spoof(name: &str, at: usize, build: impl Fn(&[u8]) -> Vec<u8> + Send + 'static) -> Self {
        Self {
            name: name.to_owned(),
            arrives: false,
            look: Look::Capture(at),
            build: Box::new(build),
        }
    }

    /// A spoof that must not change the state `changed` reads.
    pub fn spoof_state(
        name: &str,
        changed: impl Fn() -> Option<String> + Send + 'static,
        build: impl Fn(&[u8]) -> Vec<u8> + Send + 'static,
    ) -> Self {
        Self {
            name: name.to_owned(),
            arrives: false,
            look: Look::State(Box::new(changed)),
            build: Box::new(build),
        }
    }
}

/// One case's outcome: its name, what was expected (`arrives` / `dropped`) and seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The case's name.
    pub name: String,
    /// `arrives` or `dropped`.
    pub expected: String,
    /// What was seen.
    pub seen: String,
}

/// Sends every case out of `ifname` in namespace `ns` and looks for each (see the module docs);
/// `tag` makes the markers unique to the run.
#[must_use]
pub fn run(
    ns: &str,
    ifname: &str,
    captures: &[Capture],
    cases: &[Case],
    tag: &str,
) -> Vec<Outcome> {
    let marker = |i: usize| format!("vmnet-hostile-{tag}-{}-{i}", std::process::id()).into_bytes();
    let sent: Vec<Result<(), String>> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| send_frame(ns, ifname, &(c.build)(&marker(i))).map_err(|e| e.to_string()))
        .collect();
    let seen_in = |i: usize, at: usize, wait: Duration| {
        captures
            .get(at)
            .is_some_and(|cap| cap.saw(&marker(i), wait))
    };
    let mut out: Vec<Option<Outcome>> = cases.iter().map(|_| None).collect();
    for (i, c) in cases.iter().enumerate().filter(|(_, c)| c.arrives) {
        let seen = match (&sent[i], &c.look) {
            (Err(e), _) => format!("not sent: {e}"),
            (Ok(()), Look::Capture(at)) if seen_in(i, *at, HONEST_WAIT) => "arrives".into(),
            (Ok(()), _) => "missing".into(),
        };
        out[i] = Some(Outcome {
            name: c.name.clone(),
            expected: "arrives".into(),
            seen,
        });
    }
    std::thread::sleep(SPOOF_WAIT);
    for (i, c) in cases.iter().enumerate().filter(|(_, c)| !c.arrives) {
        let seen = match (&sent[i], &c.look) {
            (Err(e), _) => format!("not sent: {e}"),
            (Ok(()), Look::Capture(at)) if seen_in(i, *at, Duration::ZERO) => "arrives".into(),
            (Ok(()), Look::Capture(_)) => "dropped".into(),
            (Ok(()), Look::State(changed)) => {
                changed().map_or_else(|| "dropped".into(), |what| format!("acted on: {what}"))
            }
        };
        out[i] = Some(Outcome {
            name: c.name.clone(),
            expected: "dropped".into(),
            seen,
        });
    }
    out.into_iter().flatten().collect()
}

/// The change of each drop counter from `before` to `after`, for the kinds in `expected`
/// (kind, expected increase): `(kind, "+expected", "+seen")`.
#[must_use]
pub fn counter_moves(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
    expected: &[(&str, u64)],
) -> Vec<(String, String, String)> {
    expected
        .iter()
        .map(|(kind, n)| {
            let b = before.get(*kind).copied().unwrap_or(0);
            let a = after.get(*kind).copied().unwrap_or(0);
            (
                (*kind).to_owned(),
                format!("+{n}"),
                format!("+{}", a.saturating_sub(b)),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_moves_compare_each_kind() {
        let before = [("arp".to_owned(), 3u64)].into_iter().collect();
        let after = [("arp".to_owned(), 5u64), ("mac".to_owned(), 1)]
            .into_iter()
            .collect();
        assert_eq!(
            counter_moves(
                &before,
                &after,
                &[("arp", 2), ("mac", 1), ("ipv4_source", 1)]
            ),
            vec![
                ("arp".into(), "+2".into(), "+2".into()),
                ("mac".into(), "+1".into(), "+1".into()),
                ("ipv4_source".into(), "+1".into(), "+0".into()),
            ]
        );
    }
}
