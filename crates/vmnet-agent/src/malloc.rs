//! The agent's use of glibc's allocator, tuned for a long-lived process whose RSS must stay
//! small (issue 15: < 64 MiB with 1,000 VMs and every namespace-mode feature on).
//!
//! - [`limit_arenas`]: glibc gives each thread that allocates while the others hold their
//!   arenas an arena of its own, up to 8 per core. The agent's per-VM kernel work runs on short
//!   threads inside each VM's netns, so the freed memory of those threads (libnftables
//!   contexts of ~0.7 MiB, netlink buffers) ended up spread over many arenas, each keeping its
//!   own free pages. With [`ARENAS`] arena it stays in one heap, where it is reused. Measured
//!   with `vmnet-lab bench agent --count 1000 --all-features` (release, back to back, one run each):
//!   glibc's default gave 56.8–68.2 MiB at 1,000 VMs and 64.8–77.2 MiB with the guests' 1,000
//!   metadata connections open (target < 64 MiB); one arena gave 48.3–52.2 and 53.8–56.9 MiB.
//!   Two arenas came between (48.6–56.8 and 55.7–61.2), too close to the target under load.
//! - The cost: the threads now share one arena's lock. The reconcile pass over 1,000 VMs took
//!   about a quarter longer (12.2 s against 9.8 s) and the last hundred of 1,000 PUTs about 40 %
//!   longer (median 50.7 against 35.9 ms); the PUT median moved less than the noise
//!   (18.5 against 19.2 ms). `MALLOC_ARENA_MAX` in the agent's environment overrides it.
//! - [`release_free`]: gives the free memory the allocator holds back to the kernel, once per
//!   reconcile pass.
//!
//! Both do nothing where the C library is not glibc.

/// The number of malloc arenas the agent allows glibc (see the module docs).
pub const ARENAS: i32 = 1;

/// Limits glibc to [`ARENAS`] malloc arenas (`mallopt(M_ARENA_MAX, ARENAS)`), unless
/// `MALLOC_ARENA_MAX` is set in the environment (glibc applied it already; the operator's
/// choice wins). Call on the main thread before any other thread starts. Returns whether the
/// limit was set here.
#[must_use]
pub fn limit_arenas() -> bool {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return false;
    }
    set_arena_max()
}

#[cfg(target_env = "gnu")]
fn set_arena_max() -> bool {
    // SAFETY: mallopt only changes the allocator's tuning; M_ARENA_MAX takes effect for arenas
    // created from now on, and no other thread exists yet to hold one.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, ARENAS) == 1 }
}

#[cfg(not(target_env = "gnu"))]
fn set_arena_max() -> bool {
    false
}

/// Gives the memory the allocator holds free back to the kernel (glibc `malloc_trim(0)`).
pub fn release_free() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the kernel; 0 keeps no padding.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_wins_and_release_is_safe_to_call() {
        // The test harness may set the variable or not; either way the answer follows it.
        let set_in_env = std::env::var_os("MALLOC_ARENA_MAX").is_some();
        let set = limit_arenas();
        if set_in_env {
            assert!(!set);
        } else {
            assert_eq!(set, cfg!(target_env = "gnu"));
        }
        release_free();
    }
}
