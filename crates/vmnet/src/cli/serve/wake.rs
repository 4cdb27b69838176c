//! Wake on packet at start: the activity program told to copy what it is to hold, and the
//! service that reads it ([`vmnet_agent::wake`]).

use std::sync::Arc;
use std::time::Duration;

use vmnet_agent::agent::Agent;
use vmnet_model::Error;

use super::ServeArgs;
use super::chain;

/// The largest frame wake on packet holds: a jumbo frame.
const WAKE_MAX_FRAME: u32 = 9216;

/// Pages of each CPU's perf buffer for held frames (256 KiB with 4 KiB pages).
const WAKE_PAGES: usize = 64;

/// Turns wake on packet on (unless `--wake-hold-secs 0`): the program starts copying the frames
/// it is to hold, and the returned service reads them once started.
pub(super) fn start_wake(
    args: &ServeArgs,
    agent: &Arc<Agent>,
    rec: &vmnet_kernel::activity::ActivityRecorder,
) -> Result<
    Option<(
        Arc<vmnet_agent::wake::Wake>,
        vmnet_kernel::activity::HeldReader,
    )>,
    Error,
> {
    if args.wake_hold_secs == 0 {
        return Ok(None);
    }
    let reader = rec.hold(WAKE_MAX_FRAME, WAKE_PAGES).map_err(|e| {
        Error::unavailable(format!(
            "wake on packet: {} (--wake-hold-secs 0 runs without it)",
            chain(&e)
        ))
    })?;
    let settings = vmnet_agent::wake::WakeSettings {
        limits: vmnet_agent::wake::hold::Limits {
            frames: usize::try_from(args.wake_hold_frames).unwrap_or(usize::MAX),
            bytes: usize::try_from(args.wake_hold_bytes).unwrap_or(usize::MAX),
            time: Duration::from_secs(args.wake_hold_secs),
        },
        max_frame: WAKE_MAX_FRAME,
        interval: Duration::from_millis(args.wake_interval_ms),
        deliver: if args.wake_deliver == "first-frame" {
            vmnet_agent::wake::Deliver::FirstFrame
        } else {
            vmnet_agent::wake::Deliver::Attach
        },
        hook: args.wake_hook_socket.clone(),
    };
    let w = Arc::new(vmnet_agent::wake::Wake::new(settings, &args.name_prefix));
    agent.set_wake(Arc::clone(&w))?;
    tracing::info!(hold_secs = args.wake_hold_secs, hook = ?args.wake_hook_socket, "wake on packet on");
    Ok(Some((w, reader)))
}
