//! Pool mode in `vmnet serve`: the root helper's command line and the pool node started with it.

use super::*;

/// The root helper command: `--pool-helper`, else `vmnet-pool-helper` next to this executable,
/// else this executable as `vmnet serve --pool-helper-serve`. Its environment is cleared. The
/// returned closure makes the command again for every restart of the helper.
fn helper_command(args: &ServeArgs) -> Result<impl Fn() -> Command + Send + Sync + 'static, Error> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::unavailable(format!("pool root helper: this executable: {e}")))?;
    let installed = exe.with_file_name("vmnet-pool-helper");
    let chosen = args.pool_helper.clone();
    Ok(move || {
        let mut cmd = match &chosen {
            Some(p) => Command::new(p),
            None if installed.is_file() => Command::new(&installed),
            None => {
                let mut c = Command::new(&exe);
                c.args(["serve", "--pool-helper-serve"]);
                c
            }
        };
        cmd.env_clear();
        cmd
    })
}

/// Starts pool mode for `host_id` (see the module docs).
pub(super) async fn start_pool(
    g: &Global,
    args: &ServeArgs,
    host_id: &str,
    agent: &Agent,
) -> Result<Arc<PoolNode>, Error> {
    let bridge: IfName = args
        .bridge
        .parse()
        .map_err(|e: ValidationError| Error::invalid(format!("--bridge: {}", e.message())))?;
    let owner = TapOwner {
        uid: args.tap_owner.map(|(u, _)| u),
        gid: args.tap_owner.and_then(|(_, g)| g),
    };
    // The whole process already lives in --netns (if any): taps are made where the agent is.
    let mut taps = KernelTaps::new(None, owner)?;
    if args.no_tap_guard {
        tracing::warn!(
            "tap guard off (--no-tap-guard): guests are unfiltered while the tables are missing"
        );
    } else {
        taps = taps.with_guard(None).map_err(|e| {
            Error::new(
                e.code,
                format!("{} (--no-tap-guard runs without it)", e.message),
            )
        })?;
    }
    if args.create_bridge && taps.ensure_bridge(&bridge).await? {
        tracing::info!(%bridge, "bridge created");
    }
    let helper = HelperClient::spawn(helper_command(args)?)
        .map_err(|e| Error::unavailable(format!("pool root helper: {e}")))?;
    let cfg = PoolConfig {
        host_id: host_id.to_owned(),
        bridge,
        seed_dir: g.state_dir.join("pool").join("seeds"),
        seed_images: seeds::image_tool_available(),
    };
    PoolNode::start(cfg, helper, Arc::new(taps), agent.db(), AUDIT_PERIOD).await
}
