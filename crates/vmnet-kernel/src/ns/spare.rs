//! One network namespace made ahead of the VM that will get it, so a create does not wait for
//! the kernel to build one.
//!
//! Making a netns (`unshare(CLONE_NEWNET)`: every per-namespace subsystem initialised, the
//! loopback registered) is the longest single step of a VM's create, and it needs nothing of
//! the VM. After each create the driver makes the next VM's namespace on a short-lived thread of
//! its own, off the create's path: loopback up and the namespace sysctls of the last plan
//! written. The next create mounts it under the VM's name instead of making one.
//!
//! The spare has no name and no mount: only this process's descriptor holds it, so the kernel
//! frees it when the agent exits, however it exits, and nothing of it is left to sweep. It
//! holds no link a VM could reach. A create that finds a spare still being made waits for it
//! (at most [`WAIT`]); one that finds none makes its namespace itself.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nix::sched::{CloneFlags, unshare};

/// How long a create waits for a spare being made before making its own namespace. Making one
/// takes well under a millisecond on an idle host.
const WAIT: Duration = Duration::from_millis(20);

/// A namespace made ahead: its descriptor, and the sysctls written in it.
#[derive(Debug)]
pub(super) struct Spare {
    /// `/proc/thread-self/ns/net` of the thread that made it, opened there.
    pub fd: OwnedFd,
    /// The `(path under /proc/sys, value)` pairs written in it.
    pub sysctls: Vec<(String, String)>,
}

#[derive(Debug, Default)]
enum Slot {
    #[default]
    Empty,
    Making,
    Ready(Spare),
}

/// The driver's one spare namespace (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Spares {
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl Spares {
    /// Takes the spare: the ready one, or the one being made once it is ready (waiting at most
    /// [`WAIT`]); `None` when there is none. Blocks: call it from a blocking thread.
    pub(super) fn take(&self) -> Option<Spare> {
        let slot = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut slot, _) = self
            .changed
            .wait_timeout_while(slot, WAIT, |s| matches!(s, Slot::Making))
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match std::mem::take(&mut *slot) {
            Slot::Ready(s) => Some(s),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Starts making a spare with `sysctls` on a thread of its own, unless one is ready or
    /// being made. A failure is logged and leaves none (creates then make their own).
    pub(super) fn refill(self: &Arc<Self>, sysctls: &[(String, String)]) {
        {
            let mut slot = self
                .slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !matches!(*slot, Slot::Empty) {
                return;
            }
            *slot = Slot::Making;
        }
        let me = Arc::clone(self);
        let sysctls = sysctls.to_vec();
        let started = std::thread::Builder::new()
            .name("vmnet-spare-ns".into())
            .spawn(move || {
                // A panic must not leave the slot `Making`: every create would wait for it.
                let made = std::panic::catch_unwind(|| make(sysctls))
                    .unwrap_or_else(|_| Err("the thread panicked".into()));
                let mut slot = me.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                *slot = match made {
                    Ok(s) => Slot::Ready(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "making a spare netns failed; the next create makes its own");
                        Slot::Empty
                    }
                };
                me.changed.notify_all();
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "starting the spare netns thread failed");
            *self
                .slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Slot::Empty;
            self.changed.notify_all();
        }
    }
}

/// Makes a namespace on the calling thread (which stays in it and must exit afterwards),
/// with loopback up and `sysctls` written.
fn make(sysctls: Vec<(String, String)>) -> Result<Spare, String> {
    unshare(CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare: {e}"))?;
    let fd = std::fs::File::open("/proc/thread-self/ns/net")
        .map_err(|e| format!("open /proc/thread-self/ns/net: {e}"))?;
    super::inns::link_up("lo", None).map_err(|e| format!("set lo up: {e}"))?;
    super::inns::write_sysctls("(spare)", &sysctls).map_err(|e| e.to_string())?;
    Ok(Spare {
        fd: fd.into(),
        sysctls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn spare() -> Spare {
        Spare {
            fd: std::fs::File::open("/dev/null").unwrap().into(),
            sysctls: vec![("net/ipv4/ip_forward".into(), "1".into())],
        }
    }

    #[test]
    fn none_at_once_when_no_spare_is_ready_or_being_made() {
        let s = Spares::default();
        let at = Instant::now();
        assert!(s.take().is_none());
        assert!(at.elapsed() < WAIT, "waited {:?}", at.elapsed());
    }

    #[test]
    fn a_ready_spare_is_taken_once() {
        let s = Spares::default();
        *s.slot.lock().unwrap() = Slot::Ready(spare());
        let got = s.take().expect("the ready spare");
        assert_eq!(got.sysctls, spare().sysctls);
        assert!(s.take().is_none(), "taken twice");
    }

    #[test]
    fn a_take_waits_for_the_spare_being_made() {
        let s = Arc::new(Spares::default());
        *s.slot.lock().unwrap() = Slot::Making;
        let maker = Arc::clone(&s);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(3));
            *maker.slot.lock().unwrap() = Slot::Ready(spare());
            maker.changed.notify_all();
        });
        assert!(s.take().is_some(), "the spare made meanwhile");
        t.join().unwrap();
    }

    #[test]
    fn a_take_gives_up_on_a_spare_that_takes_too_long() {
        let s = Spares::default();
        *s.slot.lock().unwrap() = Slot::Making;
        let at = Instant::now();
        assert!(s.take().is_none());
        assert!(at.elapsed() >= WAIT);
        // Still being made: the maker's result fills the slot later.
        assert!(matches!(*s.slot.lock().unwrap(), Slot::Making));
    }

    #[test]
    fn refill_leaves_a_ready_spare_alone() {
        let s = Arc::new(Spares::default());
        *s.slot.lock().unwrap() = Slot::Ready(spare());
        s.refill(&[]);
        let kept = s.take().expect("the spare that was ready");
        assert_eq!(kept.sysctls, spare().sysctls, "not replaced");
    }
}
