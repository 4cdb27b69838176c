//! The guest guard run on a given frame by the kernel's `BPF_PROG_TEST_RUN` (through `aya`'s
//! [`TestRun`]): its cost per frame against the guard's real maps, for the benchmark
//! (`vmnet-lab bench guard`).
//!
//! The run happens in a VM's netns with the frame arriving on the VM's tap, so the program
//! reads that namespace's inode number and finds the VM's entry as on real traffic.

use std::time::Duration;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use vmnet_plan::ns::guard::PROGRAM;

use super::{GuestGuard, GuestGuardError};

/// What one test run found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardRunCost {
    /// The program's return value as a tc verdict: -1 `TC_ACT_UNSPEC` (passed), 2
    /// `TC_ACT_SHOT` (dropped).
    pub verdict: i32,
    /// The mean time of one run, as the kernel measured it over all repetitions.
    pub per_frame: Duration,
}

/// The size of `struct __sk_buff`, the context of a `sched_cls` program.
const SK_BUFF_LEN: usize = 192;
/// The offset of `ifindex` in `struct __sk_buff`.
const IFINDEX_AT: usize = 40;

impl GuestGuard {
    /// Runs the program `repeat` times on `frame` (an Ethernet frame) as if the guest of the VM
    /// in netns `netns` sent it on `tap`. A dropped frame counts in the VM's drop counters
    /// like a real one.
    ///
    /// # Errors
    /// [`GuestGuardError::Tap`] (`test run`) when the namespace or the tap is not there or the
    /// kernel refuses the run.
    pub fn test_run_in(
        &self,
        netns: &str,
        tap: &str,
        frame: &[u8],
        repeat: u32,
    ) -> Result<GuardRunCost, GuestGuardError> {
        let err = |source: Box<dyn std::error::Error + Send + Sync>| GuestGuardError::Tap {
            tap: tap.to_owned(),
            op: "test run",
            source,
        };
        let bpf = self.lock();
        let prog: &SchedClassifier = bpf
            .program(PROGRAM)
            .ok_or_else(|| err(format!("no program {PROGRAM}").into()))?
            .try_into()
            .map_err(|e| err(Box::new(e)))?;
        let name = tap.to_owned();
        let run = move || -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
            let ifindex = nix::net::if_::if_nametoindex(name.as_str())?;
            let mut ctx = [0u8; SK_BUFF_LEN];
            ctx[IFINDEX_AT..IFINDEX_AT + 4].copy_from_slice(&ifindex.to_ne_bytes());
            Ok(prog.test_run(TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat: repeat.max(1),
                ..TestRunOptions::default()
            })?)
        };
        let r = crate::netns::run_in(netns, run)
            .map_err(|e| err(Box::new(e)))?
            .map_err(err)?;
        Ok(GuardRunCost {
            verdict: i32::from_ne_bytes(r.return_value.to_ne_bytes()),
            per_frame: r.duration,
        })
    }
}
