//! The mesh programs' cost per packet, part of `vmnet-lab bench mesh --case forwarding`: each
//! forwarding decision run by the kernel (`BPF_PROG_TEST_RUN`, [`MeshPlane::test_run`]) on a
//! 1380-byte VM packet against the lab hosts' real maps, by two builds of the programs loaded
//! on the same maps: vmnet's, and one whose `mesh_from_vm` does not check sources
//! ([`MeshPlane::load_without_source_check`]). The two are measured alternately (ABBA), in
//! [`ROUNDS`] rounds each, and each build's median over the rounds is shown with the
//! difference: the source check's cost per packet (the goal: at most [`GOAL_NS`] ns).
//!
//! A round of a case whose packet the program leaves as it is (a drop, a pass) is one kernel
//! run of [`REPEAT`] repetitions (the kernel returns their mean). A case whose program changes
//! the packet (encapsulation, decapsulation) cannot repeat it (the next repetition would see
//! the changed packet and take another path): its round is the median of [`SINGLES`] single
//! runs. Each run asserts the verdict it measures, so a number always belongs to the path it
//! names.
//!
//! Cases: on host A, a VM's packet to a VM on host B (encapsulated), the same packet with
//! another VM's mesh address as its source (dropped; without the check it is encapsulated,
//! which the bench asserts once, so that build is shown to lack the check), to a VM of another
//! tenant (dropped), to an address outside the mesh (passed on to the host's routes at once;
//! and, for a VM with a route via a gateway VM, after the host's route lookup); on host B, an
//! encapsulated packet from host A's side for a local VM (checked, decapsulated, redirected:
//! `mesh_from_wg` has no source check, so its two builds are the same code, a control of the
//! method's noise). The decapsulation case's sender is a registration of host `fdaa:0:86dd::1`
//! (see [`vmnet_kernel::mesh::Side`] on why its address has those bytes).

use std::net::Ipv6Addr;
use std::time::Duration;

use vmnet_kernel::mesh::{LocalVm, Location, MeshPlane, Side};
use vmnet_model::Error;
use vmnet_sandbox::mesh_lab::{LabHost, LabVm, MeshLab, VM_LL};
use vmnet_sandbox::netns;

/// Rounds per case and build (even: ABBA order).
pub const ROUNDS: usize = 10;
/// Repetitions in one kernel run of a case that leaves its packet as it is.
pub const REPEAT: u32 = 100_000;
/// Single runs in one round of a case that changes its packet.
pub const SINGLES: usize = 2_000;
/// The goal: the source check costs at most this many ns per packet on every case.
pub const GOAL_NS: f64 = 20.0;

/// The VM packet size, IPv6 header included (the VM MTU).
const PACKET: usize = 1380;

/// tc verdicts.
const UNSPEC: i32 = -1;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;

/// The sending host of the decapsulation case (bytes 4–5 read as the IPv6 ether type).
const SENDER: Ipv6Addr = Ipv6Addr::new(0xfdaa, 0, 0x86dd, 0, 0, 0, 0, 1);
/// A VM of another tenant (registered on host B), and one behind [`SENDER`].
const OTHER_TENANT: Ipv6Addr = Ipv6Addr::new(0xfdaa, 0xc0, 0, 0, 0, 0, 0, 2);
const REMOTE: Ipv6Addr = Ipv6Addr::new(0xfdaa, 0xc0, 0, 0, 0, 0, 0, 9);
/// An address outside the mesh, routed by host A to its wg0.
const OUTSIDE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xc057, 0, 0, 0, 0, 1);

/// One measured case.
#[derive(Debug, Clone)]
pub struct CostRow {
    /// The decision measured.
    pub case: &'static str,
    /// The program.
    pub program: &'static str,
    /// How a round measures: `mean` of [`REPEAT`] repetitions or `median` of [`SINGLES`] runs.
    pub method: &'static str,
    /// vmnet's build: the median over the rounds of one packet's time.
    pub checked: Duration,
    /// The build without the source check, the same way (`None`: the case is the check's own
    /// drop, which that build does not make).
    pub unchecked: Option<Duration>,
}

impl CostRow {
    /// The source check's cost on this case in ns (checked minus unchecked).
    #[must_use]
    pub fn difference_ns(&self) -> Option<f64> {
        self.unchecked
            .map(|u| self.checked.as_secs_f64() * 1e9 - u.as_secs_f64() * 1e9)
    }
}

/// Whether every compared case stays within [`GOAL_NS`].
#[must_use]
pub fn goal_met(rows: &[CostRow]) -> bool {
    rows.iter()
        .filter_map(CostRow::difference_ns)
        .all(|d| d <= GOAL_NS)
}

/// An IPv6 packet of `len` bytes (TCP, no options) from `src` to `dst`.
#[must_use]
pub fn ipv6_tcp(src: Ipv6Addr, dst: Ipv6Addr, len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len.max(60)];
    p[0] = 0x60;
    let payload = u16::try_from(p.len() - 40).unwrap_or(u16::MAX);
    p[4..6].copy_from_slice(&payload.to_be_bytes());
    p[6] = 6; // TCP
    p[7] = 64;
    p[8..24].copy_from_slice(&src.octets());
    p[24..40].copy_from_slice(&dst.octets());
    p[40..42].copy_from_slice(&40000u16.to_be_bytes());
    p[42..44].copy_from_slice(&5201u16.to_be_bytes());
    p[52] = 5 << 4; // data offset: 5 words
    p[53] = 0x10; // ACK
    p
}

/// `packet` in an Ethernet frame (IPv6 ether type), as a VM's veth delivers it.
#[must_use]
pub fn ethernet(packet: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x06, 0, 0xac, 0x10, 0, 2, 0x86, 0xdd];
    f.extend_from_slice(packet);
    f
}

/// `inner` encapsulated as the mesh sends it: an outer IPv6 header from `from` to `to`, the
/// destination VM's user id in the flow label, next header 41 (IPv6).
#[must_use]
pub fn encapsulated(from: Ipv6Addr, to: Ipv6Addr, user_id: u32, inner: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 40];
    let label = user_id & 0xf_ffff;
    p[0] = 0x60;
    p[1] = u8::try_from(label >> 16).unwrap_or(0);
    p[2] = u8::try_from((label >> 8) & 0xff).unwrap_or(0);
    p[3] = u8::try_from(label & 0xff).unwrap_or(0);
    let payload = u16::try_from(inner.len()).unwrap_or(u16::MAX);
    p[4..6].copy_from_slice(&payload.to_be_bytes());
    p[6] = 41;
    p[7] = 64;
    p[8..24].copy_from_slice(&from.octets());
    p[24..40].copy_from_slice(&to.octets());
    p.extend_from_slice(inner);
    p
}

fn err(what: &str) -> impl Fn(vmnet_kernel::mesh::MeshError) -> Error + '_ {
    move |e| {
        Error::unavailable(format!(
            "bench mesh forwarding: cost: {what}: {}",
            vmnet_model::error::chain(&e)
        ))
    }
}

/// The two builds of one host's programs.
struct Builds<'a> {
    checked: &'a MeshPlane,
    unchecked: MeshPlane,
}

impl<'a> Builds<'a> {
    fn load(host: &'a LabHost) -> Result<Self, Error> {
        let unchecked =
            MeshPlane::load_without_source_check(Some(&host.net.ns), host.plane.pin_root())
                .map_err(err("load the build without the source check"))?;
        Ok(Self {
            checked: &host.plane,
            unchecked,
        })
    }
}

/// One round of `case` on `plane`: the time of one packet.
fn round(plane: &MeshPlane, case: &Case<'_>, changes_packet: bool) -> Result<Duration, Error> {
    let check = |verdict: i32| {
        if verdict == case.want {
            Ok(())
        } else {
            Err(Error::internal(format!(
                "bench mesh forwarding: cost: {}: verdict {verdict} (expected {})",
                case.name, case.want
            )))
        }
    };
    if !changes_packet {
        let r = plane
            .test_run(case.side, case.dev, case.frame, REPEAT)
            .map_err(err(case.name))?;
        check(r.verdict)?;
        return Ok(r.per_packet);
    }
    let mut times = Vec::with_capacity(SINGLES);
    for _ in 0..SINGLES {
        let r = plane
            .test_run(case.side, case.dev, case.frame, 1)
            .map_err(err(case.name))?;
        check(r.verdict)?;
        times.push(r.per_packet);
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// A decision to measure.
struct Case<'a> {
    name: &'static str,
    side: Side,
    dev: &'a str,
    frame: &'a [u8],
    want: i32,
}

/// [`ROUNDS`] rounds of `case` on each build, alternately (ABBA); the check's own drop
/// (`spoof`) only on vmnet's build.
fn measure(builds: &Builds<'_>, case: &Case<'_>, spoof: bool) -> Result<CostRow, Error> {
    // The two cases whose program rewrites the packet (it pushes or strips a header).
    let changes_packet = matches!(case.name, ENCAP | DECAP);
    let (mut checked, mut unchecked) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS {
        let order = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for with in order {
            if with {
                checked.push(round(builds.checked, case, changes_packet)?);
            } else if !spoof {
                unchecked.push(round(&builds.unchecked, case, changes_packet)?);
            }
        }
    }
    Ok(CostRow {
        case: case.name,
        program: match case.side {
            Side::FromVm => "mesh_from_vm",
            Side::FromWg => "mesh_from_wg",
        },
        method: if changes_packet { "median" } else { "mean" },
        checked: median(checked),
        unchecked: (!spoof).then(|| median(unchecked)),
    })
}

const ENCAP: &str = "VM to a VM on another host: encapsulated";
const DECAP: &str = "from wg0 to a local VM: decapsulated";

/// Measures every case with VM `a` (tenant 1) on host 0 and VM `c` (tenant 1) on host 1.
///
/// # Errors
/// `UNAVAILABLE` when a load, map write, route or run fails; `INTERNAL` when a case ends in
/// another verdict than its own (or an encapsulation was not counted, or the build without
/// the check drops a spoofed source).
pub fn run(lab: &MeshLab, a: &LabVm, c: &LabVm) -> Result<Vec<CostRow>, Error> {
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let (b0, b1) = (Builds::load(h0)?, Builds::load(h1)?);
    let mut rows = Vec::new();
    let on_a = |name, frame, want| Case {
        name,
        side: Side::FromVm,
        dev: &a.veth,
        frame,
        want,
    };

    let to_c = ethernet(&ipv6_tcp(a.mesh, c.mesh, PACKET));
    let before = h0.plane.passes().map_err(err("counters"))?["encapsulated"];
    rows.push(measure(&b0, &on_a(ENCAP, &to_c, UNSPEC), false)?);
    let after = h0.plane.passes().map_err(err("counters"))?["encapsulated"];
    let expected = (2 * ROUNDS * SINGLES) as u64;
    if after - before < expected {
        return Err(Error::internal(format!(
            "bench mesh forwarding: cost: {} of {expected} runs encapsulated",
            after - before
        )));
    }

    // The VM sending as another VM (c's mesh address): vmnet's build drops it before any
    // lookup of the destination; the build without the check encapsulates it.
    let spoofed = ethernet(&ipv6_tcp(c.mesh, c.mesh, PACKET));
    let name = "VM sending as another VM's mesh address: dropped";
    rows.push(measure(&b0, &on_a(name, &spoofed, SHOT), true)?);
    let r = b0
        .unchecked
        .test_run(Side::FromVm, &a.veth, &spoofed, 1)
        .map_err(err(name))?;
    if r.verdict != UNSPEC {
        return Err(Error::internal(format!(
            "bench mesh forwarding: cost: the build without the source check gives a spoofed \
             source verdict {} (expected {UNSPEC}: encapsulated)",
            r.verdict
        )));
    }

    let other = Location {
        host: h1.mesh,
        user_id: 2,
        tenant: a.tenant + 1,
    };
    h0.plane
        .put_location(OTHER_TENANT, &other)
        .map_err(err("location"))?;
    let to_other = ethernet(&ipv6_tcp(a.mesh, OTHER_TENANT, PACKET));
    let name = "VM to another tenant: dropped";
    rows.push(measure(&b0, &on_a(name, &to_other, SHOT), false)?);

    let route = format!("{OUTSIDE}/48");
    netns::ip(
        &h0.net.ns,
        &["-6", "route", "replace", &route, "dev", &h0.wg],
    )
    .map_err(|e| Error::unavailable(format!("bench mesh forwarding: cost: route: {e}")))?;
    let out = ethernet(&ipv6_tcp(a.mesh, OUTSIDE, PACKET));
    let name = "VM to outside the mesh: no gateway route";
    rows.push(measure(&b0, &on_a(name, &out, UNSPEC), false)?);
    let with_gateway = |routes_via_mesh| LocalVm {
        user_id: a.user_id,
        veth: a.veth.clone(),
        tenant: a.tenant,
        mesh: a.mesh,
        via: VM_LL,
        routes_via_mesh,
        gateway: false,
    };
    h0.plane
        .put_local(&with_gateway(true))
        .map_err(err("local vm"))?;
    let name = "VM with a gateway route to outside: route lookup";
    let looked_up = measure(&b0, &on_a(name, &out, UNSPEC), false);
    h0.plane
        .put_local(&with_gateway(false))
        .map_err(err("local vm"))?;
    rows.push(looked_up?);

    let remote = Location {
        host: SENDER,
        user_id: 9,
        tenant: c.tenant,
    };
    h1.plane
        .put_location(REMOTE, &remote)
        .map_err(err("location"))?;
    let wire = encapsulated(
        SENDER,
        h1.mesh,
        c.user_id,
        &ipv6_tcp(REMOTE, c.mesh, PACKET),
    );
    let decap = Case {
        name: DECAP,
        side: Side::FromWg,
        dev: &h1.wg,
        frame: &wire,
        want: REDIRECT,
    };
    rows.push(measure(&b1, &decap, false)?);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decapsulation_sender_reads_as_an_ipv6_ether_type() {
        let f = encapsulated(
            SENDER,
            Ipv6Addr::LOCALHOST,
            0x1_2345,
            &ipv6_tcp(REMOTE, REMOTE, 80),
        );
        assert_eq!(&f[12..14], &[0x86, 0xdd], "bytes 12-13 of the outer header");
        assert_eq!(f[0] >> 4, 6);
        assert_eq!(
            (u32::from(f[1] & 0x0f) << 16) | (u32::from(f[2]) << 8) | u32::from(f[3]),
            0x1_2345
        );
        assert_eq!(u16::from_be_bytes([f[4], f[5]]), 80);
        assert_eq!(f[6], 41);
    }

    #[test]
    fn a_vm_frame_is_ethernet_then_ipv6_of_the_given_length() {
        let f = ethernet(&ipv6_tcp(REMOTE, OUTSIDE, PACKET));
        assert_eq!(f.len(), 14 + PACKET);
        assert_eq!(&f[12..14], &[0x86, 0xdd]);
        assert_eq!(
            u16::from_be_bytes([f[18], f[19]]),
            u16::try_from(PACKET - 40).unwrap()
        );
        assert_eq!(&f[14 + 24..14 + 40], &OUTSIDE.octets());
    }
}
