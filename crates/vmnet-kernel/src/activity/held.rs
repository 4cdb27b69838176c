//! Held frames: what the activity program copies of a frame the kernel is about to drop because
//! the VM's tap has no VMM (see `bpf/activity.bpf.c`, "Wake on packet"), read from its perf
//! buffers.
//!
//! # Design
//! - One perf buffer per online CPU ([`PerfEventArray`]), all registered with one `epoll`
//!   instance, which is the one descriptor tokio watches ([`HeldReader::wait`]).
//!   [`HeldReader::drain`] reads every buffer to its end, in the order each CPU wrote; frames
//!   of one flow are queued by one CPU at a time, so their order holds.
//! - A sample is a 16-byte header (user id, the frame's length, how many of its bytes follow,
//!   whether it is TCP from the host side) and the frame's bytes as the kernel queued them.
//!   A frame longer than the configured largest is reported with no bytes: counted, not held.
//! - The kernel counts samples it could not write (a buffer full); they are reported as lost.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use aya::maps::perf::{PerfEvent, PerfEventArrayBuffer};
use aya::maps::{MapData, PerfEventArray};
use rustix::event::epoll;
use tokio::io::unix::AsyncFd;

/// The perf event array the program writes held frames to.
pub(crate) const FRAMES_MAP: &str = "wake_frames";
/// The one-entry array of the agent's wake settings.
pub(crate) const CFG_MAP: &str = "wake_cfg";

/// The size of a sample's header.
const HEADER: usize = 16;

/// One frame the kernel was about to drop for a VM without its VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldFrame {
    /// The VM's user id.
    pub uid: u32,
    /// The frame's length.
    pub len: u32,
    /// Whether it counts as activity (TCP from the host side).
    pub tcp: bool,
    /// The frame, Ethernet header first; empty when it was longer than the largest held.
    pub bytes: Vec<u8>,
}

/// What one [`HeldReader::drain`] read.
#[derive(Debug, Default)]
pub struct Drained {
    /// The frames, in order per CPU.
    pub frames: Vec<HeldFrame>,
    /// Samples the kernel could not write (a buffer was full).
    pub lost: u64,
}

/// The perf buffers of the held frames (see the module docs).
pub struct HeldReader {
    bufs: Vec<PerfEventArrayBuffer<MapData>>,
    epoll: AsyncFd<OwnedFd>,
}

impl std::fmt::Debug for HeldReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldReader")
            .field("buffers", &self.bufs.len())
            .finish_non_exhaustive()
    }
}

/// Parses one sample (its two parts, the second empty unless it wrapped around the buffer).
fn parse(head: &[u8], tail: &[u8]) -> Option<HeldFrame> {
    let mut s = head.to_vec();
    s.extend_from_slice(tail);
    let word = |i: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(
            s.get(i * 4..i * 4 + 4)?.try_into().ok()?,
        ))
    };
    let (uid, len, caplen, tcp) = (word(0)?, word(1)?, word(2)?, word(3)?);
    let end = HEADER.checked_add(usize::try_from(caplen).ok()?)?;
    let bytes = s.get(HEADER..end)?.to_vec();
    Some(HeldFrame {
        uid,
        len,
        tcp: tcp != 0,
        bytes,
    })
}

impl HeldReader {
    /// Opens one buffer of `pages` pages (a power of two) per online CPU on `map`.
    pub(crate) fn open(mut map: PerfEventArray<MapData>, pages: usize) -> io::Result<Self> {
        let cpus = aya::util::online_cpus()
            .map_err(|(what, e)| io::Error::other(format!("{what}: {e}")))?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let mut bufs = Vec::with_capacity(cpus.len());
        for (i, cpu) in cpus.into_iter().enumerate() {
            let b = map
                .open(cpu, Some(pages))
                .map_err(|e| io::Error::other(format!("perf buffer of cpu {cpu}: {e}")))?;
            epoll::add(
                &ep,
                b.as_fd(),
                epoll::EventData::new_u64(i as u64),
                epoll::EventFlags::IN,
            )?;
            bufs.push(b);
        }
        // SAFETY: the epoll descriptor is owned by the AsyncFd from here on.
        let epoll = unsafe { AsyncFd::register_with_interest(ep, tokio::io::Interest::READABLE) }?;
        Ok(Self { bufs, epoll })
    }

    /// Waits until some buffer may have samples.
    ///
    /// # Errors
    /// When tokio cannot poll the descriptor.
    pub async fn wait(&self) -> io::Result<()> {
        let mut g = self.epoll.readable().await?;
        g.clear_ready();
        Ok(())
    }

    /// Reads every buffer to its end.
    pub fn drain(&mut self) -> Drained {
        let mut evs = Vec::with_capacity(self.bufs.len().max(1));
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // Consumes the readiness reports; every buffer is read below whichever reported.
        let _ = epoll::wait(
            self.epoll.get_ref(),
            rustix::buffer::spare_capacity(&mut evs),
            Some(&zero),
        );
        let mut out = Drained::default();
        for b in &mut self.bufs {
            b.for_each(|ev| match ev {
                PerfEvent::Sample { head, tail } => {
                    if let Some(f) = parse(head, tail) {
                        out.frames.push(f);
                    }
                }
                PerfEvent::Lost { count } => out.lost += count,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(uid: u32, len: u32, caplen: u32, tcp: u32, frame: &[u8]) -> Vec<u8> {
        let mut s = Vec::new();
        for w in [uid, len, caplen, tcp] {
            s.extend_from_slice(&w.to_ne_bytes());
        }
        s.extend_from_slice(frame);
        s.extend_from_slice(&[0; 4]); // the kernel's padding
        s
    }

    #[test]
    fn a_sample_gives_its_frame_without_the_padding() {
        let s = sample(7, 5, 5, 1, b"abcde");
        let f = parse(&s, &[]).expect("parsed");
        assert_eq!((f.uid, f.len, f.tcp), (7, 5, true));
        assert_eq!(f.bytes, b"abcde");
    }

    #[test]
    fn a_sample_split_at_the_buffer_end_is_joined() {
        let s = sample(1, 6, 6, 0, b"abcdef");
        let f = parse(&s[..18], &s[18..]).expect("parsed");
        assert_eq!(f.bytes, b"abcdef");
        assert!(!f.tcp);
    }

    #[test]
    fn a_frame_too_long_to_hold_has_no_bytes_and_a_short_sample_is_refused() {
        let f = parse(&sample(3, 70_000, 0, 1, &[]), &[]).expect("parsed");
        assert_eq!((f.len, f.bytes.len()), (70_000, 0));
        assert!(parse(&sample(3, 9, 9, 1, b"abc")[..19], &[]).is_none());
    }
}
