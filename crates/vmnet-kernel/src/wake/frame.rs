//! The frame logic of wake on packet: which flow a held frame belongs to (what a wake event
//! reports), and the transport checksum a held frame may still need.
//!
//! # Checksums
//! The kernel may hand a frame to a device with its TCP or UDP checksum left for the device to
//! finish (`CHECKSUM_PARTIAL`: the field holds only the sum of the pseudo-header, and the
//! offload metadata says so). A tap passes that metadata to the VMM. A held copy carries the
//! bytes only, so [`complete_checksum`] finishes such a checksum before the copy is sent again:
//! a field that already holds the right checksum, or any other value, is left as it is, so the
//! guest receives the bytes it would have received, with the checksum the offload would have
//! written. IPv4 and IPv6 (no extension headers), unfragmented TCP and UDP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const ETH: usize = 14;
const TCP: u8 = 6;
const UDP: u8 = 17;

/// A frame's flow: protocol number, addresses and ports (0 when the protocol has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// The IP protocol number (6 TCP, 17 UDP, …).
    pub proto: u8,
    /// Source address.
    pub src: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination address.
    pub dst: IpAddr,
    /// Destination port.
    pub dport: u16,
}

/// The IP header of a frame: protocol, addresses, where the transport header starts and where
/// the IP packet ends; `None` when the frame is not IPv4/IPv6 or is cut short or a fragment
/// past the first.
struct Ip {
    proto: u8,
    src: IpAddr,
    dst: IpAddr,
    l4: usize,
    end: usize,
    first: bool,
}

fn ip(f: &[u8]) -> Option<Ip> {
    let ethertype = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    match ethertype {
        0x0800 => {
            let h = f.get(ETH..ETH + 20)?;
            let ihl = usize::from(h[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
            let frag = u16::from_be_bytes([h[6], h[7]]);
            if h[0] >> 4 != 4 || ihl < 20 || total < ihl || ETH + total > f.len() {
                return None;
            }
            Some(Ip {
                proto: h[9],
                src: IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15])),
                dst: IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19])),
                l4: ETH + ihl,
                end: ETH + total,
                // More fragments, or an offset: not a whole datagram.
                first: frag & 0x3fff == 0,
            })
        }
        0x86dd => {
            let h = f.get(ETH..ETH + 40)?;
            let plen = usize::from(u16::from_be_bytes([h[4], h[5]]));
            if h[0] >> 4 != 6 || ETH + 40 + plen > f.len() {
                return None;
            }
            let a = |o: usize| -> Option<Ipv6Addr> {
                Some(Ipv6Addr::from(
                    <[u8; 16]>::try_from(h.get(o..o + 16)?).ok()?,
                ))
            };
            Some(Ip {
                proto: h[6],
                src: IpAddr::V6(a(8)?),
                dst: IpAddr::V6(a(24)?),
                l4: ETH + 40,
                end: ETH + 40 + plen,
                first: true,
            })
        }
        _ => None,
    }
}

/// The flow of `frame`, when it is IPv4 or IPv6 (ports for TCP and UDP; with IPv6, only
/// without extension headers).
#[must_use]
pub fn flow(frame: &[u8]) -> Option<Flow> {
    let p = ip(frame)?;
    let (sport, dport) = match p.proto {
        TCP | UDP if p.first => {
            let t = frame.get(p.l4..p.l4 + 4)?;
            (
                u16::from_be_bytes([t[0], t[1]]),
                u16::from_be_bytes([t[2], t[3]]),
            )
        }
        _ => (0, 0),
    };
    Some(Flow {
        proto: p.proto,
        src: p.src,
        sport,
        dst: p.dst,
        dport,
    })
}

/// The ones' complement sum of `b` (big-endian 16-bit words, an odd last byte padded), added
/// to `acc`, not folded.
fn sum(mut acc: u64, b: &[u8]) -> u64 {
    let mut it = b.chunks_exact(2);
    for w in &mut it {
        acc += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = it.remainder() {
        acc += u64::from(u16::from_be_bytes([*last, 0]));
    }
    acc
}

fn fold(mut acc: u64) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    u16::try_from(acc).unwrap_or(0xffff)
}

/// The pseudo-header's sum for a segment of `len` bytes.
fn pseudo(p: &Ip, len: usize) -> u64 {
    let mut acc = match (p.src, p.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => sum(sum(0, &s.octets()), &d.octets()),
        (IpAddr::V6(s), IpAddr::V6(d)) => sum(sum(0, &s.octets()), &d.octets()),
        _ => 0,
    };
    acc += u64::from(p.proto);
    acc += u64::try_from(len).unwrap_or(0);
    acc
}

/// Finishes a TCP or UDP checksum the kernel left for the device (see the module docs):
/// `true` when it wrote one.
pub fn complete_checksum(frame: &mut [u8]) -> bool {
    let Some(p) = ip(frame) else { return false };
    let at = match p.proto {
        TCP => 16,
        UDP => 6,
        _ => return false,
    };
    if !p.first || p.l4 + at + 2 > p.end {
        return false;
    }
    let seg_len = p.end - p.l4;
    let field = p.l4 + at;
    let stored = u16::from_be_bytes([frame[field], frame[field + 1]]);
    let partial = fold(pseudo(&p, seg_len));
    if stored != partial {
        return false;
    }
    frame[field] = 0;
    frame[field + 1] = 0;
    let mut c = !fold(sum(pseudo(&p, seg_len), &frame[p.l4..p.end]));
    if c == 0 && p.proto == UDP {
        c = 0xffff;
    }
    frame[field..field + 2].copy_from_slice(&c.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet + IPv4 + TCP SYN from 203.0.113.9:40000 to 172.16.0.2:80, checksum `csum`.
    fn syn4(csum: u16) -> Vec<u8> {
        let mut f = vec![0u8; 14];
        f[12] = 0x08;
        let mut ip = vec![0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, TCP, 0, 0];
        ip.extend_from_slice(&[203, 0, 113, 9, 172, 16, 0, 2]);
        f.extend_from_slice(&ip);
        let mut tcp = vec![0u8; 20];
        tcp[..4].copy_from_slice(&[0x9c, 0x40, 0, 80]);
        tcp[12] = 5 << 4;
        tcp[13] = 0x02;
        tcp[14..16].copy_from_slice(&[0xfa, 0xf0]);
        tcp[16..18].copy_from_slice(&csum.to_be_bytes());
        f.extend_from_slice(&tcp);
        f
    }

    /// The correct checksum of `syn4`, computed the long way.
    fn correct4() -> u16 {
        let f = syn4(0);
        let mut acc = sum(0, &[203, 0, 113, 9, 172, 16, 0, 2]);
        acc += u64::from(TCP) + 20;
        !fold(sum(acc, &f[34..]))
    }

    #[test]
    fn the_flow_of_a_tcp_frame() {
        let f = flow(&syn4(0)).expect("a flow");
        assert_eq!(f.proto, TCP);
        assert_eq!(
            (f.src.to_string(), f.sport),
            ("203.0.113.9".to_owned(), 40000)
        );
        assert_eq!((f.dst.to_string(), f.dport), ("172.16.0.2".to_owned(), 80));
        assert!(flow(&[0u8; 20]).is_none());
        assert!(flow(&syn4(0)[..30]).is_none());
    }

    #[test]
    fn a_partial_checksum_is_finished_and_any_other_left_alone() {
        let partial = fold(sum(0, &[203, 0, 113, 9, 172, 16, 0, 2]) + u64::from(TCP) + 20);
        let mut f = syn4(partial);
        assert!(complete_checksum(&mut f));
        assert_eq!(u16::from_be_bytes([f[50], f[51]]), correct4());
        let mut good = syn4(correct4());
        assert!(!complete_checksum(&mut good));
        assert_eq!(good, syn4(correct4()));
        let mut bad = syn4(0x1234);
        assert!(!complete_checksum(&mut bad));
        assert_eq!(bad, syn4(0x1234));
    }

    #[test]
    fn ipv6_udp_partial_checksum_is_finished() {
        let mut f = vec![0u8; 14];
        f[12..14].copy_from_slice(&[0x86, 0xdd]);
        let src: Ipv6Addr = "2001:db8::9".parse().expect("addr");
        let dst: Ipv6Addr = "fdaa::2".parse().expect("addr");
        let mut h = vec![0x60, 0, 0, 0, 0, 12, UDP, 64];
        h.extend_from_slice(&src.octets());
        h.extend_from_slice(&dst.octets());
        f.extend_from_slice(&h);
        f.extend_from_slice(&[0x30, 0x39, 0x00, 0x35, 0, 12, 0, 0, b'p', b'i', b'n', b'g']);
        let mut acc = sum(sum(0, &src.octets()), &dst.octets()) + u64::from(UDP) + 12;
        let partial = fold(acc);
        f[60..62].copy_from_slice(&partial.to_be_bytes());
        assert!(complete_checksum(&mut f));
        let got = u16::from_be_bytes([f[60], f[61]]);
        f[60] = 0;
        f[61] = 0;
        acc = sum(acc, &f[54..]);
        assert_eq!(got, !fold(acc));
        let fl = flow(&f).expect("a flow");
        assert_eq!((fl.sport, fl.dport), (12345, 53));
    }
}
