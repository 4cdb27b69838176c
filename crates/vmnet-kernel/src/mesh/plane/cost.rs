//! The mesh programs run on a given packet by the kernel's `BPF_PROG_TEST_RUN` (through
//! `aya`'s [`TestRun`]): their cost per packet against the plane's real maps, for the
//! benchmark (`vmnet-lab bench mesh --case forwarding`).
//!
//! The kernel hands a `sched_cls` program under test an Ethernet frame (it parses the first 14
//! bytes as an Ethernet header for the skb's protocol), also when the device named in the
//! context has no link layer, as wg0. A frame for the WireGuard-side program therefore starts
//! directly with the outer IPv6 header, and bytes 12–13 of that header (bytes 4–5 of the outer
//! source address) must read `86 dd`, the IPv6 ether type: the caller picks a sending host
//! address with those bytes (e.g. `fdaa:0:86dd::1`).

use std::path::Path;
use std::time::Duration;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};

use super::{FROM_VM, FROM_WG, MeshPlane};
use crate::mesh::MeshError;

/// Which of the two programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// `mesh_from_vm`, on a VM's host veth end: encapsulation, tenant checks, local pass.
    FromVm,
    /// `mesh_from_wg`, on wg0: checks and decapsulation towards a local VM.
    FromWg,
}

/// What one test run found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestRunCost {
    /// The program's return value as a tc verdict: -1 `TC_ACT_UNSPEC` (passed on), 2
    /// `TC_ACT_SHOT` (dropped), 7 `TC_ACT_REDIRECT` (delivered to a VM's veth).
    pub verdict: i32,
    /// The mean time of one run, as the kernel measured it over all repetitions.
    pub per_packet: Duration,
}

/// The size of `struct __sk_buff`, the context of a `sched_cls` program.
const SK_BUFF_LEN: usize = 192;
/// The offset of `ifindex` in `struct __sk_buff`.
const IFINDEX_AT: usize = 40;

impl MeshPlane {
    /// Loads a copy of the programs whose `mesh_from_vm` does not check sources (its
    /// `check_sources` off: the verifier removes the check), on the maps pinned under
    /// `pin_root`, and attaches nothing: for measuring the check's cost beside a plane loaded
    /// with [`MeshPlane::load`] on the same maps. vmnet itself never loads it.
    ///
    /// # Errors
    /// As [`MeshPlane::load`].
    pub fn load_without_source_check(ns: Option<&str>, pin_root: &Path) -> Result<Self, MeshError> {
        Self::load_with(ns, pin_root, super::OBJECT, false)
    }

    /// Runs `side`'s program `repeat` times on `frame` (an Ethernet frame; see the module docs
    /// for the WireGuard side) as if it arrived on device `dev` of the plane's namespace. The
    /// program reads and writes the plane's maps as on real traffic (its counters count these
    /// runs too).
    ///
    /// # Errors
    /// [`MeshError::NoDevice`] when `dev` does not exist; [`MeshError::TestRun`] when the
    /// kernel refuses the run.
    pub fn test_run(
        &self,
        side: Side,
        dev: &str,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunCost, MeshError> {
        let ifindex = self.ifindex(dev)?;
        let program = match side {
            Side::FromVm => FROM_VM,
            Side::FromWg => FROM_WG,
        };
        let mut ctx = [0u8; SK_BUFF_LEN];
        ctx[IFINDEX_AT..IFINDEX_AT + 4].copy_from_slice(&ifindex.to_ne_bytes());
        let bpf = self.lock();
        let prog: &SchedClassifier = bpf
            .program(program)
            .ok_or_else(|| MeshError::Invalid(format!("no program {program}")))?
            .try_into()
            .map_err(|source| MeshError::TestRun { program, source })?;
        let run = || {
            prog.test_run(TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat: repeat.max(1),
                ..TestRunOptions::default()
            })
        };
        let r = self
            .in_ns(run)?
            .map_err(|source| MeshError::TestRun { program, source })?;
        Ok(TestRunCost {
            verdict: i32::from_ne_bytes(r.return_value.to_ne_bytes()),
            per_packet: r.duration,
        })
    }
}
