//! The UDP counters of a namespace (`/proc/net/snmp`, `/proc/net/snmp6` read from a thread in
//! it): how many datagrams the kernel dropped because a socket's receive or send buffer was
//! full. The mesh's benchmarks and tests read them in the namespace where `wireguard-go`
//! receives.

use crate::{SandboxError, netns};

/// The buffer errors of one namespace, both families.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdpErrors {
    /// `Udp: RcvbufErrors` (IPv4).
    pub rcvbuf4: u64,
    /// `Udp6RcvbufErrors`.
    pub rcvbuf6: u64,
    /// `Udp: SndbufErrors` (IPv4).
    pub sndbuf4: u64,
    /// `Udp6SndbufErrors`.
    pub sndbuf6: u64,
}

impl UdpErrors {
    /// Receive-buffer errors of both families.
    #[must_use]
    pub fn rcvbuf(&self) -> u64 {
        self.rcvbuf4 + self.rcvbuf6
    }

    /// What grew from `before` to `self`.
    #[must_use]
    pub fn since(&self, before: &Self) -> Self {
        Self {
            rcvbuf4: self.rcvbuf4.saturating_sub(before.rcvbuf4),
            rcvbuf6: self.rcvbuf6.saturating_sub(before.rcvbuf6),
            sndbuf4: self.sndbuf4.saturating_sub(before.sndbuf4),
            sndbuf6: self.sndbuf6.saturating_sub(before.sndbuf6),
        }
    }
}

/// The counters in the text of `/proc/net/snmp` and `/proc/net/snmp6`.
///
/// # Errors
/// `Unexpected` when a counter is missing.
pub fn parse(snmp: &str, snmp6: &str) -> Result<UdpErrors, SandboxError> {
    // snmp: a header line "Udp: InDatagrams … RcvbufErrors …" then a value line "Udp: 1 …".
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let (names, values) = (udp.next().unwrap_or(""), udp.next().unwrap_or(""));
    let v4 = |name: &str| {
        names
            .split_whitespace()
            .position(|n| n == name)
            .and_then(|i| values.split_whitespace().nth(i))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| SandboxError::Unexpected(format!("/proc/net/snmp: no Udp {name}")))
    };
    let v6 = |name: &str| {
        snmp6
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(name)).then(|| w.next().and_then(|v| v.parse::<u64>().ok()))?
            })
            .ok_or_else(|| SandboxError::Unexpected(format!("/proc/net/snmp6: no {name}")))
    };
    Ok(UdpErrors {
        rcvbuf4: v4("RcvbufErrors")?,
        rcvbuf6: v6("Udp6RcvbufErrors")?,
        sndbuf4: v4("SndbufErrors")?,
        sndbuf6: v6("Udp6SndbufErrors")?,
    })
}

/// The counters of namespace `ns`.
///
/// # Errors
/// When the namespace cannot be entered or the files read.
pub fn read(ns: &str) -> Result<UdpErrors, SandboxError> {
    let (snmp, snmp6) = netns::run_in(ns, || {
        let r = |f: &str| {
            std::fs::read_to_string(format!("/proc/thread-self/net/{f}"))
                .map_err(|e| SandboxError::io(format!("{ns}: /proc/net/{f}"), e))
        };
        Ok::<_, SandboxError>((r("snmp")?, r("snmp6")?))
    })??;
    parse(&snmp, &snmp6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_by_name() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
            Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors\n\
            Udp: 10 0 7 9 5 2 0 0 0\nUdpLite: InDatagrams\nUdpLite: 0\n";
        let snmp6 = "Udp6InDatagrams                 \t10\nUdp6RcvbufErrors                \t27129\nUdp6SndbufErrors \t3\n";
        let e = parse(snmp, snmp6).unwrap();
        assert_eq!(
            e,
            UdpErrors {
                rcvbuf4: 5,
                rcvbuf6: 27129,
                sndbuf4: 2,
                sndbuf6: 3
            }
        );
        assert_eq!(e.rcvbuf(), 27134);
        let later = UdpErrors {
            rcvbuf6: 27130,
            ..e
        };
        assert_eq!(later.since(&e).rcvbuf(), 1);
        assert!(parse("", snmp6).is_err());
        assert!(parse(snmp, "").is_err());
    }
}
