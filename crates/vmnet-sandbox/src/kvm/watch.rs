//! Watching a real guest across a change: in the guest, in the background, `ip -ts monitor
//! address route` records every address and route the kernel adds or deletes, and `ping` sends
//! an IPv4 echo request to the gateway (`172.16.0.1`) every 10 ms. [`Watch::stop`] ends both
//! and reads what they saw: how many pings went unanswered, and the monitor's events.
//!
//! The checks built on it ([`crate::ns_job::kvm`]) expect a change to show only the objects it
//! changes (a moved mesh address: the old and the new address and the routes the kernel derives
//! from them; a host route: that route) and no lost ping.

use std::time::Duration;

use super::ns::NsGuest;

/// Where the watch keeps its files in the guest.
const DIR: &str = "/run/vmnet-watch";

/// The IPv4 address the ping goes to: the guest's gateway (the tap in the VM's namespace).
pub const PING_TARGET: &str = "172.16.0.1";

/// A running watch in one guest.
#[derive(Debug)]
pub struct Watch(());

/// What a watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    /// Echo requests sent.
    pub sent: u32,
    /// Echo replies received.
    pub received: u32,
    /// The monitor's event lines, without their timestamps (continuation lines dropped).
    pub events: Vec<String>,
}

impl Watched {
    /// Pings that went unanswered.
    #[must_use]
    pub fn lost(&self) -> u32 {
        self.sent.saturating_sub(self.received)
    }

    /// The events that mention none of `allowed`.
    #[must_use]
    pub fn unexpected(&self, allowed: &[String]) -> Vec<String> {
        self.events
            .iter()
            .filter(|e| !allowed.iter().any(|a| mentions(e, a)))
            .cloned()
            .collect()
    }
}

/// Whether `line` names `what` as a whole token (`fdaa:1::8` is not in `fdaa:1::8008`).
fn mentions(line: &str, what: &str) -> bool {
    line.split_whitespace()
        .any(|w| w == what || w.split('/').next() == Some(what))
}

/// The counts of ping's summary line (`N packets transmitted, M received, …`).
#[must_use]
pub fn ping_counts(text: &str) -> Option<(u32, u32)> {
    let line = text.lines().find(|l| l.contains("packets transmitted"))?;
    let mut words = line.split_whitespace();
    let sent = words.next()?.parse().ok()?;
    let received = line
        .split(", ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((sent, received))
}

/// The event lines of `ip -ts monitor` output: the `[timestamp]` prefix removed, the
/// continuation lines (`valid_lft …`) dropped.
#[must_use]
pub fn monitor_events(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| match l.strip_prefix('[') {
            Some(rest) => rest.split_once(']').map_or(l, |(_, r)| r),
            None => l,
        })
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("valid_lft"))
        .map(str::to_owned)
        .collect()
}

impl Watch {
    /// Starts the monitor and the ping in `g` (each in its own session, so they outlive the
    /// command that starts them).
    ///
    /// # Errors
    /// What the guest printed when they did not start.
    pub fn start(g: &mut NsGuest) -> Result<Self, String> {
        let script = format!(
            "rm -rf {DIR}; mkdir -p {DIR}\n\
             setsid -f sh -c 'echo $$ >{DIR}/mon.pid; exec ip -ts monitor address route >{DIR}/mon 2>&1'\n\
             setsid -f sh -c 'echo $$ >{DIR}/ping.pid; exec ping -n -i 0.01 {PING_TARGET} >{DIR}/ping 2>&1'\n\
             sleep 0.5\n\
             kill -0 $(cat {DIR}/mon.pid) && kill -0 $(cat {DIR}/ping.pid) && echo started"
        );
        let out = g.sh(&script, Duration::from_secs(15));
        if out == "started" {
            Ok(Self(()))
        } else {
            Err(format!("watch did not start: {out}"))
        }
    }

    /// Stops the ping (SIGINT: it prints its summary) and the monitor, and reads them.
    ///
    /// # Errors
    /// What the guest printed when the ping's summary is missing.
    pub fn stop(self, g: &mut NsGuest) -> Result<Watched, String> {
        let script = format!(
            "kill -INT $(cat {DIR}/ping.pid); kill $(cat {DIR}/mon.pid)\n\
             for i in $(seq 50); do grep -q 'packets transmitted' {DIR}/ping && break; sleep 0.1; done\n\
             grep 'packets transmitted' {DIR}/ping; echo ---; cat {DIR}/mon"
        );
        let out = g.sh(&script, Duration::from_secs(20));
        let (ping, mon) = out.split_once("---").unwrap_or((out.as_str(), ""));
        let (sent, received) =
            ping_counts(ping).ok_or_else(|| format!("no ping summary: {}", out.trim()))?;
        Ok(Watched {
            sent,
            received,
            events: monitor_events(mon),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_summary_and_monitor_events_are_read() {
        assert_eq!(
            ping_counts(
                "--- 172.16.0.1 ping statistics ---\n1530 packets transmitted, 1528 received, 0.13% packet loss, time 15301ms\n"
            ),
            Some((1530, 1528))
        );
        assert_eq!(
            ping_counts("812 packets transmitted, 812 received, 0% packet loss"),
            Some((812, 812))
        );
        assert_eq!(ping_counts("ping: connect: Network is unreachable"), None);
        let mon = "[2026-12-06T21:00:01.000001] 2: eth0    inet6 fdaa:1::8008/128 scope global nodad \n\
                   [2026-12-06T21:00:01.000002]        valid_lft forever preferred_lft forever\n\
                   [2026-12-06T21:00:01.000003] local fdaa:1::8008 dev eth0 table local proto kernel metric 0 pref medium\n\
                   [2026-12-06T21:00:01.000004] Deleted 2: eth0    inet6 fdaa:1::8/128 scope global nodad \n\
                   [2026-12-06T21:00:01.000005] Deleted 2: eth0    inet 172.16.0.2/30 brd 172.16.0.3 scope global eth0\n\
                   [2026-12-06T21:00:01.000006] Deleted default via 172.16.0.1 dev eth0 proto static\n";
        let w = Watched {
            sent: 10,
            received: 9,
            events: monitor_events(mon),
        };
        assert_eq!(w.events.len(), 5);
        assert_eq!(w.lost(), 1);
        let allowed = ["fdaa:1::8".to_owned(), "fdaa:1::8008".to_owned()];
        assert_eq!(
            w.unexpected(&allowed),
            [
                "Deleted 2: eth0    inet 172.16.0.2/30 brd 172.16.0.3 scope global eth0",
                "Deleted default via 172.16.0.1 dev eth0 proto static"
            ]
        );
        // A route by its prefix; a mesh address is not a prefix of another one.
        let r = Watched {
            sent: 1,
            received: 1,
            events: vec![
                "2001:db8:ffff::/48 via fe80::1 dev eth0 proto static metric 1024 pref medium"
                    .into(),
                "fdaa:1::80 dev eth0 proto kernel metric 256 pref medium".into(),
            ],
        };
        assert_eq!(
            r.unexpected(&["2001:db8:ffff::/48".into(), "fdaa:1::8".into()]),
            ["fdaa:1::80 dev eth0 proto kernel metric 256 pref medium"]
        );
    }
}
