//! Proxy ARP/NDP entries have no change notifications: the kernel notifies neither an entry
//! added or deleted (`ip neigh add|del proxy …`) nor the entries it drops with a link set down.
//! The watcher stands in for the missing notification by reading the host's proxy entries
//! (one `RTM_GETNEIGH` dump of the proxy table, all families) every [`Watcher::poll_proxies`]
//! interval and reporting an entry that was there at the last read and is gone now as a
//! changed proxy entry of its interface. A read costs one dump, whatever changed; an added
//! entry is not reported (vmnet only ever misses its own).

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use netlink_sys::Socket;
use netlink_sys::protocols::NETLINK_ROUTE;

use super::parse::{Kind, Note};
use super::{Event, Watcher, What};

const RTM_GETNEIGH: u16 = 30;
const RTM_NEWNEIGH: u16 = 28;
const NLMSG_DONE: u16 = 3;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NTF_PROXY: u8 = 0x08;
const NDA_DST: u16 = 1;

/// One proxy entry: interface index and address.
pub(super) type Entry = (u32, IpAddr);

/// Opens a dump socket in the namespace `netns` names (`None`: the calling process's own).
pub(super) fn open(netns: Option<&str>) -> io::Result<Socket> {
    let here = || -> io::Result<Socket> {
        let mut s = Socket::new(NETLINK_ROUTE)?;
        s.bind_auto()?;
        s.set_non_blocking(false)?;
        Ok(s)
    };
    match netns {
        None => here(),
        Some(n) => crate::netns::run_in(n, here).map_err(io::Error::other)?,
    }
}

/// The dump request: `nlmsghdr` and an `ndmsg` asking for the proxy table.
fn request(seq: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[0..4].copy_from_slice(&28u32.to_ne_bytes());
    b[4..6].copy_from_slice(&RTM_GETNEIGH.to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    // ndmsg: family AF_UNSPEC (every family), ifindex 0 (every link), flags NTF_PROXY.
    b[16 + 10] = NTF_PROXY;
    b
}

/// The proxy entries in one datagram of the dump; `true` once it ends.
fn parse(buf: &[u8], out: &mut BTreeSet<Entry>) -> io::Result<bool> {
    let mut at = 0;
    while at + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap_or_default()) as usize;
        let ty = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().unwrap_or_default());
        if len < 16 || at + len > buf.len() {
            break;
        }
        let body = &buf[at + 16..at + len];
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = body
                    .get(0..4)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, i32::from_ne_bytes);
                return Err(io::Error::from_raw_os_error(-code));
            }
            RTM_NEWNEIGH if body.len() >= 12 && body[10] & NTF_PROXY != 0 => {
                let index = u32::from_ne_bytes(body[4..8].try_into().unwrap_or_default());
                let mut a = 12;
                while a + 4 <= body.len() {
                    let alen = usize::from(u16::from_ne_bytes([body[a], body[a + 1]]));
                    let aty = u16::from_ne_bytes([body[a + 2], body[a + 3]]) & 0x3fff;
                    if alen < 4 || a + alen > body.len() {
                        break;
                    }
                    let v = &body[a + 4..a + alen];
                    if aty == NDA_DST {
                        let ip = match v.len() {
                            4 => <[u8; 4]>::try_from(v).ok().map(IpAddr::from),
                            16 => <[u8; 16]>::try_from(v).ok().map(IpAddr::from),
                            _ => None,
                        };
                        if let Some(ip) = ip {
                            out.insert((index, ip));
                        }
                    }
                    a += (alen + 3) & !3;
                }
            }
            _ => {}
        }
        at += (len + 3) & !3;
    }
    Ok(false)
}

/// Reads every proxy entry of the socket's namespace (a blocking dump).
pub(super) fn dump(sock: &Socket, seq: u32) -> io::Result<BTreeSet<Entry>> {
    sock.send(&request(seq), 0)?;
    let mut out = BTreeSet::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut b: &mut [u8] = &mut buf[..];
        let n = sock.recv(&mut b, 0)?;
        if parse(&buf[..n.min(buf.len())], &mut out)? {
            return Ok(out);
        }
    }
}

/// The entries of `before` that are not in `now`.
pub(super) fn gone(before: &BTreeSet<Entry>, now: &BTreeSet<Entry>) -> Vec<Entry> {
    before.difference(now).copied().collect()
}

impl Watcher {
    /// Reads the host's proxy entries every `every` and reports an entry gone since the last
    /// read as a changed proxy entry (see the module docs), until [`Watcher::stop`].
    ///
    /// # Errors
    /// The dump socket cannot be opened in the host namespace.
    pub fn poll_proxies(&self, host: Option<&str>, every: Duration) -> io::Result<()> {
        let sock = Arc::new(Mutex::new(open(host)?));
        let tx = self.0.tx.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut before: Option<BTreeSet<Entry>> = None;
            let mut seq = 0u32;
            loop {
                tick.tick().await;
                seq = seq.wrapping_add(1);
                let s = Arc::clone(&sock);
                let read = tokio::task::spawn_blocking(move || {
                    let s = s.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    dump(&s, seq)
                })
                .await;
                let now = match read {
                    Ok(Ok(now)) => now,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "reading the proxy entries failed");
                        continue;
                    }
                    Err(_) => return,
                };
                let at = Instant::now();
                for (index, _) in before.as_ref().map(|b| gone(b, &now)).unwrap_or_default() {
                    let note = Note {
                        kind: Some(Kind::Neigh),
                        ifindex: Some(index),
                        proxy: true,
                        ..Note::default()
                    };
                    let ev = Event {
                        netns: None,
                        what: What::Changed(note),
                        at,
                    };
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
                before = Some(now);
            }
        });
        if let Ok(mut t) = self.0.polls.lock() {
            t.push(task.abort_handle());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dump_request_asks_for_the_proxy_table_and_replies_parse() {
        let r = request(7);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), RTM_GETNEIGH);
        assert_eq!(r[26], NTF_PROXY);
        // One RTM_NEWNEIGH proxy entry (ifindex 3, 203.0.113.50), then NLMSG_DONE.
        let mut m = Vec::new();
        let mut body = vec![2u8, 0, 0, 0];
        body.extend(3u32.to_ne_bytes());
        body.extend([0, 0, NTF_PROXY, 0]);
        body.extend(8u16.to_ne_bytes());
        body.extend(NDA_DST.to_ne_bytes());
        body.extend([203, 0, 113, 50]);
        m.extend(u32::try_from(16 + body.len()).unwrap().to_ne_bytes());
        m.extend(RTM_NEWNEIGH.to_ne_bytes());
        m.extend([0u8; 10]);
        m.extend(&body);
        let mut out = BTreeSet::new();
        assert!(!parse(&m, &mut out).unwrap());
        let mut done = 20u32.to_ne_bytes().to_vec();
        done.extend(NLMSG_DONE.to_ne_bytes());
        done.extend([0u8; 14]);
        assert!(parse(&done, &mut out).unwrap());
        let e: Entry = (3, "203.0.113.50".parse().unwrap());
        assert_eq!(out.iter().copied().collect::<Vec<_>>(), [e]);
        assert_eq!(gone(&out, &BTreeSet::new()), [e]);
        assert!(
            gone(&BTreeSet::new(), &out).is_empty(),
            "added entries are not reported"
        );
    }
}
