//! The mesh programs' drop, spoof and pass counters, summed over CPUs.

use super::*;

impl MeshPlane {
    pub(super) fn counters(
        &self,
        map: &'static str,
        names: &[&'static str],
    ) -> Result<BTreeMap<&'static str, u64>, MeshError> {
        let bpf = self.lock();
        let m = bpf.map(map).ok_or(MeshError::Map {
            map,
            source: aya::maps::MapError::InvalidName { name: map.into() },
        })?;
        let arr = PerCpuArray::<_, u64>::try_from(m).map_err(map_err(map))?;
        let mut out = BTreeMap::new();
        for (i, name) in (0u32..).zip(names) {
            let per_cpu = arr.get(&i, 0).map_err(map_err(map))?;
            out.insert(*name, per_cpu.iter().sum());
        }
        Ok(out)
    }

    /// Packets dropped so far by reason ([`DROP_REASONS`]), summed over CPUs, since the maps
    /// were first pinned.
    ///
    /// # Errors
    /// A map error.
    pub fn drops(&self) -> Result<BTreeMap<&'static str, u64>, MeshError> {
        let (reasons, spoofs) = DROP_REASONS.split_at(DROP_REASONS.len() - 1);
        let mut out = self.counters(maps::DROPS, reasons)?;
        out.extend(self.counters(maps::SPOOFS, spoofs)?);
        Ok(out)
    }

    /// Packets forwarded so far by kind ([`PASS_KINDS`]), summed over CPUs.
    ///
    /// # Errors
    /// A map error.
    pub fn passes(&self) -> Result<BTreeMap<&'static str, u64>, MeshError> {
        self.counters(maps::PASSES, &PASS_KINDS)
    }
}
