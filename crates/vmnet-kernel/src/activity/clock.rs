//! The two clocks of packet activity: the program stamps `CLOCK_BOOTTIME`, callers want wall
//! time.

use std::time::{Duration, SystemTime};

/// `CLOCK_BOOTTIME` now, ns.
pub(super) fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists on every Linux we run on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &raw mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// The wall-clock time of boot-clock reading `t`, given both clocks read now.
#[must_use]
pub fn wall_time(t_boot_ns: u64, now_boot_ns: u64, now_wall: SystemTime) -> SystemTime {
    if t_boot_ns >= now_boot_ns {
        now_wall
    } else {
        now_wall - Duration::from_nanos(now_boot_ns - t_boot_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_times_convert_to_wall_clock_from_one_reading() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            wall_time(7_000_000_000, 10_000_000_000, now),
            now - Duration::from_secs(3)
        );
        // A time from the future (clock read before the program wrote) is now, never later.
        assert_eq!(wall_time(11_000_000_000, 10_000_000_000, now), now);
    }
}
