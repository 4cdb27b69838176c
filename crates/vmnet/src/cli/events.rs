//! `vmnet events`: the agent's events (`GET /v1/events`), one line each as they come.
//!
//! With `--output json` every line is the event's JSON object exactly as the agent sent it
//! (NDJSON, ready for `jq`); otherwise one text line per event: sequence number, time, kind, VM
//! and the kind's fields as `key=value`. Each line is written as soon as it arrives. When the
//! reader of the output goes away (`vmnet events --follow | head -3`), the command ends quietly
//! at its next line (the default `SIGPIPE` disposition, which `main` restores).

use std::fmt::Write as _;

use serde_json::Value;
use vmnet_agent::client::{Client, segment};
use vmnet_agent::events::KINDS;
use vmnet_model::Error;

use crate::{Global, Output};

// Its doc is the command's help summary, word for word `ClientCmd::Events`'s: `vmnet` defers
// the command's arguments, and then this summary is the one shown.
/// What the agent does, one line per event: VMs applied, deleted or failed, drift
/// repaired, firewall repairs, mesh peers, provider poll failures, spoof drops.
#[derive(Debug, clap::Args)]
pub struct EventsArgs {
    /// Keep printing new events as they happen (until interrupted); without it, print the
    /// events the agent keeps (the last 1024) and end.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Only events about this VM (repeatable, or a comma list).
    #[arg(long = "vm", value_name = "ID", value_delimiter = ',')]
    pub vms: Vec<String>,
    /// Only events of this kind (repeatable, or a comma list).
    #[arg(long = "kind", value_name = "KIND", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(KINDS))]
    pub kinds: Vec<String>,
    /// Only events after this sequence number; with --follow, the kept ones after it come
    /// first (resume after a `lagged` line with its `last_seq`).
    #[arg(long, value_name = "SEQ")]
    pub since: Option<u64>,
    /// The agent run --since belongs to (the `run` of the event or `lagged` line, in
    /// `--output json`): when the agent restarted since, the command fails with `CONFLICT`
    /// instead of resuming in the new run.
    #[arg(long, value_name = "ID", requires = "since")]
    pub run: Option<String>,
}

/// The query string of `a`.
fn query(a: &EventsArgs) -> String {
    let mut q = vec![format!("follow={}", a.follow)];
    q.extend(a.vms.iter().map(|v| format!("vm={}", segment(v))));
    q.extend(a.kinds.iter().map(|k| format!("kind={}", segment(k))));
    if let Some(s) = a.since {
        q.push(format!("since={s}"));
    }
    if let Some(r) = &a.run {
        q.push(format!("run={}", segment(r)));
    }
    q.join("&")
}

/// One event as a text line: `SEQ TIME KIND VM key=value …` (`-` for no VM; the run, the same
/// on every line, is left out).
#[must_use]
pub fn text_line(line: &str) -> String {
    let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(line) else {
        return line.to_owned();
    };
    let mut take = |k: &str| o.remove(k);
    let seq = take("seq").map_or_else(|| "-".to_owned(), |v| v.to_string());
    let time = take("time").and_then(|v| v.as_str().map(str::to_owned));
    let kind = take("kind").and_then(|v| v.as_str().map(str::to_owned));
    let vm = take("vm").and_then(|v| v.as_str().map(str::to_owned));
    take("run");
    let mut out = format!(
        "{seq:>6} {} {:<20} {:<16}",
        time.as_deref().unwrap_or("-"),
        kind.as_deref().unwrap_or("-"),
        vm.as_deref().unwrap_or("-"),
    );
    for (k, v) in &o {
        let shown = match v {
            Value::String(s) if !s.is_empty() && !s.contains(char::is_whitespace) => s.clone(),
            other => other.to_string(),
        };
        let _ = write!(out, " {k}={shown}");
    }
    out
}

/// Runs `vmnet events`.
pub async fn events(g: &Global, a: EventsArgs) -> Result<(), Error> {
    let client = Client::new(&g.socket);
    let json = g.output == Output::Json;
    // A line that cannot be written ends the stream and is the command's error.
    let mut failed = None;
    client
        .events_lines(&query(&a), |l| {
            let written = if json {
                vmnet_cli::outln!("{l}")
            } else {
                vmnet_cli::outln!("{}", text_line(l))
            };
            written.map_err(|e| failed = Some(e)).is_ok()
        })
        .await?;
    failed.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_one_text_line_with_its_fields() {
        let l = r#"{"run":"0123456789abcdef","seq":7,"time":"2025-01-01T00:00:00.000Z","vm":"web-1","user_id":7,"kind":"drift_repaired","objects":["link"],"netns":"vmn0007","trigger":"notification","detail":"repair vmn0007: tap vmt0007 missing, made again"}"#;
        let t = text_line(l);
        assert!(
            t.starts_with("     7 2025-01-01T00:00:00.000Z drift_repaired       web-1"),
            "{t}"
        );
        assert!(
            t.contains(r#" objects=["link"] "#) && t.contains(" trigger=notification"),
            "{t}"
        );
        assert!(t.contains(r#"detail="repair vmn0007: tap"#), "{t}");
        assert!(!t.contains("run"), "{t}");
        let lagged = text_line(r#"{"kind":"lagged","missed":3,"last_seq":9}"#);
        assert!(
            lagged.contains("lagged") && lagged.contains("missed=3"),
            "{lagged}"
        );
    }

    #[test]
    fn the_query_carries_every_filter() {
        let a = EventsArgs {
            follow: true,
            vms: vec!["a".into(), "b".into()],
            kinds: vec!["vm_applied".into()],
            since: Some(4),
            run: Some("0123456789abcdef".into()),
        };
        assert_eq!(
            query(&a),
            "follow=true&vm=a&vm=b&kind=vm_applied&since=4&run=0123456789abcdef"
        );
    }
}
