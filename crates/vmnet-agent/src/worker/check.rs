//! The agent's check of what the worker answers: a poll's outcome is data from a process that
//! parses the internet's answers, so it is trusted only as far as it matches the job the agent
//! sent. A report may name only the job's instances, each at most once, with at most
//! [`MAX_ADDRESSES`] addresses; texts are cut to [`MAX_TEXT`] bytes. Anything else is a
//! protocol violation: the agent ends the worker and fails the poll.

use std::collections::BTreeSet;

use vmnet_ipam::MachinePoll;

use super::proto::WireReport;
use crate::provider::{PollError, PollReport};

/// The most addresses one machine may report.
pub const MAX_ADDRESSES: usize = 256;
/// The longest text (an error's words, a URL) kept from the worker, bytes.
pub const MAX_TEXT: usize = 1024;

/// `s` cut to [`MAX_TEXT`] bytes (at a character boundary), marked when cut.
fn cut(s: &mut String) {
    if s.len() > MAX_TEXT {
        let mut end = MAX_TEXT;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str(" [cut]");
    }
}

/// `e` with every text cut (see [`cut`]).
#[must_use]
pub fn error(mut e: PollError) -> PollError {
    match &mut e {
        PollError::Credentials(s) | PollError::Refused(s) => cut(s),
        PollError::Auth { what, .. }
        | PollError::RateLimited { what, .. }
        | PollError::Status { what, .. }
        | PollError::Timeout { what, .. } => cut(what),
        PollError::Unreachable { what, why } | PollError::Malformed { what, why } => {
            cut(what);
            cut(why);
        }
    }
    e
}

/// The report the worker sent for a job over `asked` (the job's instance ids), checked.
///
/// # Errors
/// A sentence naming what does not match the job.
pub fn report(asked: &BTreeSet<&str>, wire: WireReport) -> Result<PollReport, String> {
    let known = |id: &str, what: &str| {
        if asked.contains(id) {
            Ok(())
        } else {
            Err(format!(
                "{what} names instance {id:?}, which the poll did not ask for"
            ))
        }
    };
    let mut seen = BTreeSet::new();
    let mut results = Vec::with_capacity(wire.results.len());
    for m in wire.results {
        known(&m.instance_id, "a result")?;
        if !seen.insert(m.instance_id.clone()) {
            return Err(format!("instance {:?} has two results", m.instance_id));
        }
        if let Some(a) = &m.addresses
            && a.len() > MAX_ADDRESSES
        {
            return Err(format!(
                "instance {:?} has {} addresses (at most {MAX_ADDRESSES})",
                m.instance_id,
                a.len()
            ));
        }
        results.push(MachinePoll {
            instance_id: m.instance_id,
            addresses: m.addresses,
        });
    }
    for id in &wire.missing {
        known(id, "the missing list")?;
    }
    let mut errors = Vec::with_capacity(wire.errors.len());
    for (id, e) in wire.errors {
        known(&id, "an error")?;
        errors.push((id, error(e)));
    }
    Ok(PollReport {
        results,
        missing: wire.missing,
        errors,
        requests: wire.requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::proto::WireMachine;

    fn wire(results: Vec<WireMachine>) -> WireReport {
        WireReport {
            results,
            missing: vec![],
            errors: vec![],
            requests: 3,
        }
    }

    fn m(id: &str, n: usize) -> WireMachine {
        WireMachine {
            instance_id: id.into(),
            addresses: Some(vec!["203.0.113.5/32".parse().unwrap(); n]),
        }
    }

    #[test]
    fn only_the_jobs_instances_once_each() {
        let asked: BTreeSet<&str> = ["a", "b"].into();
        let ok = report(&asked, wire(vec![m("a", 1), m("b", 2)])).unwrap();
        assert_eq!(ok.results.len(), 2);
        assert_eq!(ok.requests, 3);
        let e = report(&asked, wire(vec![m("c", 1)])).unwrap_err();
        assert!(e.contains("\"c\""), "{e}");
        assert!(report(&asked, wire(vec![m("a", 1), m("a", 1)])).is_err());
        assert!(report(&asked, wire(vec![m("a", MAX_ADDRESSES + 1)])).is_err());
        let mut w = wire(vec![]);
        w.missing = vec!["zz".into()];
        assert!(report(&asked, w).is_err());
        let mut w = wire(vec![]);
        w.errors = vec![("b".into(), PollError::Credentials("é".repeat(2000)))];
        let r = report(&asked, w).unwrap();
        let PollError::Credentials(s) = &r.errors[0].1 else {
            panic!()
        };
        assert!(
            s.len() <= MAX_TEXT + 6 && s.ends_with(" [cut]"),
            "{}",
            s.len()
        );
    }
}
