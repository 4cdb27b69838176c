//! A frame relay between two taps: what a VMM's virtio-net device does between the host tap and
//! the guest, with the guest replaced by a tap in another namespace.
//!
//! [`Relay::start`] opens the VM's tap in the VM's namespace (attaching to the persistent tap
//! the agent made, as a VMM does) and creates a tap (normally `eth0`) in the guest namespace,
//! then copies frames both ways on two threads. `vmnet-lab sandbox-helper relay` runs the same code
//! as a background process.
//!
//! By default both taps are opened as Firecracker and qemu open theirs
//! ([`Framing::VirtioNet`]): `IFF_VNET_HDR` and checksum/TSO/USO offloads, so a TCP burst crosses
//! as GSO frames of up to 64 KiB with their virtio-net header, copied unchanged (the header a
//! tap hands the VMM is the header the guest's tap accepts). [`Relay::start_with`] and
//! [`Framing::Plain`] keep the old behaviour, one MTU-sized frame per read and write, for a test
//! that needs wire-sized frames.
//!
//! # Limitations
//! Frames that cannot be written (a tap that is down, a header the kernel refuses) are counted
//! and dropped, as a NIC would. One thread per direction, one frame per system call.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::tap::Framing;
use crate::{SandboxError, tap};

/// The read buffer: the largest GSO frame (64 KiB of IP packet, Ethernet header) and the
/// virtio-net header, rounded up.
const BUF_LEN: usize = 128 * 1024;

/// Frame counters of a relay, one direction each.
#[derive(Debug, Default)]
pub struct RelayCounters {
    /// Frames copied from the VM's tap to the guest.
    pub to_guest: AtomicU64,
    /// Frames copied from the guest to the VM's tap.
    pub from_guest: AtomicU64,
    /// Frames that could not be written.
    pub dropped: AtomicU64,
}

/// A snapshot of [`RelayCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayStats {
    /// Frames copied from the VM's tap to the guest.
    pub to_guest: u64,
    /// Frames copied from the guest to the VM's tap.
    pub from_guest: u64,
    /// Frames that could not be written.
    pub dropped: u64,
}

/// A running relay; stops (and closes both taps) when dropped.
#[derive(Debug)]
pub struct Relay {
    stop: Arc<AtomicBool>,
    counters: Arc<RelayCounters>,
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Attaches to the existing tap `tap` in `vm_ns`, creates the tap `guest_if` in `guest_ns`
    /// and starts copying frames, with virtio-net headers and offloads ([`Framing::VirtioNet`]).
    ///
    /// # Errors
    /// When either tap cannot be opened.
    pub fn start(
        vm_ns: &str,
        tap: &str,
        guest_ns: &str,
        guest_if: &str,
    ) -> Result<Self, SandboxError> {
        Self::start_with(vm_ns, tap, guest_ns, guest_if, Framing::VirtioNet)
    }

    /// As [`Relay::start`], with both taps opened with `framing`.
    ///
    /// # Errors
    /// When either tap cannot be opened.
    pub fn start_with(
        vm_ns: &str,
        tap: &str,
        guest_ns: &str,
        guest_if: &str,
        framing: Framing,
    ) -> Result<Self, SandboxError> {
        let vm = tap::open_existing_tap_with(vm_ns, tap, framing)?;
        let guest = tap::create_tap(guest_ns, guest_if, framing)?;
        Self::between(vm, guest)
    }

    /// Copies frames between two open tap descriptors (`vm` is the VMM side, `guest` the guest
    /// side). Both must have the same framing: frames are copied byte for byte.
    ///
    /// # Errors
    /// When a descriptor cannot be duplicated or a thread cannot be started.
    pub fn between(vm: File, guest: File) -> Result<Self, SandboxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(RelayCounters::default());
        let vm2 = vm
            .try_clone()
            .map_err(|e| SandboxError::io("relay: dup vm tap", e))?;
        let guest2 = guest
            .try_clone()
            .map_err(|e| SandboxError::io("relay: dup guest tap", e))?;
        let mut threads = Vec::new();
        for (from, to, to_guest) in [(vm, guest2, true), (guest, vm2, false)] {
            let (stop, counters) = (Arc::clone(&stop), Arc::clone(&counters));
            let name = if to_guest {
                "relay-to-guest"
            } else {
                "relay-from-guest"
            };
            let h = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || copy_frames(from, to, &stop, &counters, to_guest))
                .map_err(|e| SandboxError::io("relay: spawn", e))?;
            threads.push(h);
        }
        Ok(Self {
            stop,
            counters,
            threads,
        })
    }

    /// The frames copied so far.
    #[must_use]
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            to_guest: self.counters.to_guest.load(Ordering::Relaxed),
            from_guest: self.counters.from_guest.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
        }
    }

    /// Blocks for as long as the relay runs (a background relay process ends on a signal).
    pub fn wait(mut self) {
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Waits up to 100 ms for `fd` to become readable.
fn readable(fd: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd for an open descriptor, and the count passed is 1.
    let n = unsafe { libc::poll(&raw mut pfd, 1, 100) };
    n > 0 && pfd.revents & libc::POLLIN != 0
}

fn copy_frames(
    mut from: File,
    mut to: File,
    stop: &AtomicBool,
    counters: &RelayCounters,
    to_guest: bool,
) {
    let mut buf = vec![0u8; BUF_LEN];
    while !stop.load(Ordering::Relaxed) {
        if !readable(from.as_raw_fd()) {
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => continue,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // EIO etc.: the device went away (namespace deleted); wait for stop.
            Err(_) => {
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        if to.write(&buf[..n]).is_ok() {
            let c = if to_guest {
                &counters.to_guest
            } else {
                &counters.from_guest
            };
            c.fetch_add(1, Ordering::Relaxed);
        } else {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}
