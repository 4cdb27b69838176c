//! The restarts of `vmnet-lab package-vm` ([`super::package_vm_guest`]): the agent killed, the
//! agent stopped (the watchdog), the package reinstalled, each while the guest pings through the
//! VM's tap; the agent must come back ready and the VM's netns, tap and traffic stay as they are.

use super::package_vm_guest::{Guest, NETNS, READYZ, TAP, get, judged, kv};
use crate::pool_job::checks::Check;

/// What is done to the running agent while the guest pings.
#[derive(Clone, Copy)]
pub(super) enum Disruption {
    /// `kill -9`: systemd restarts it (`Restart=on-failure`).
    Kill,
    /// `kill -STOP`: the watchdog (the unit's 30 s) fires and systemd restarts it.
    Stop,
    /// `apt-get install --reinstall`: the package's postinst restarts it.
    Reinstall,
}

pub(super) fn disrupt(g: &mut Guest, d: Disruption) -> Result<Vec<Check>, String> {
    let (what, action, restarts) = match d {
        Disruption::Kill => ("kill -9 of the agent", "kill -9 \"$pid\"".to_owned(), 1),
        Disruption::Stop => (
            "SIGSTOP of the agent (watchdog)",
            "kill -STOP \"$pid\"".to_owned(),
            1,
        ),
        Disruption::Reinstall => (
            "apt-get install --reinstall (an upgrade)",
            format!(
                "DEBIAN_FRONTEND=noninteractive apt-get install --reinstall -y -q -o Dpkg::Use-Pty=0 \
                 /mnt/pkg/{} >/run/pkgvm/reinstall.log 2>&1 || echo \"reinstall=failed: $(tail -n 5 /run/pkgvm/reinstall.log | xargs)\"",
                g.deb
            ),
            0,
        ),
    };
    let script = format!(
        r#"pid=$(systemctl show -p MainPID --value vmnet)
n0=$(systemctl show -p NRestarts --value vmnet)
ns0=$(stat -L -c %i /run/netns/{NETNS})
tap0=$(ip -n {NETNS} -o link show {TAP} | cut -d: -f1)
since=$(date +%s)
setsid ip netns exec pkgg ping -n -i 0.05 {peer} >/run/pkgvm/ping.log 2>&1 </dev/null &
ping=$!
sleep 2
t0=$(date +%s%N)
{action}
end=$((SECONDS + 300)) new=0 ready=none
while [ $SECONDS -lt $end ]; do
  new=$(systemctl show -p MainPID --value vmnet)
  if [ "$new" != 0 ] && [ "$new" != "$pid" ] && [ "$(systemctl is-active vmnet)" = active ]; then
    ready=$({READYZ})
    [ "$ready" = 200 ] && break
  fi
  sleep 0.2
done
t1=$(date +%s%N)
sleep 2
kill -INT $ping; wait $ping
echo "pids=$pid → $new"
echo "ready=$ready"
echo "restart_ms=$(( (t1 - t0) / 1000000 ))"
echo "nrestarts=$n0 → $(systemctl show -p NRestarts --value vmnet)"
echo "netns=$ns0 → $(stat -L -c %i /run/netns/{NETNS})"
echo "tap=$tap0 → $(ip -n {NETNS} -o link show {TAP} | cut -d: -f1)"
echo "watchdog=$(journalctl -u vmnet -q --since "@$since" | grep -c 'Watchdog timeout')"
echo "taken=$(journalctl -u vmnet -q --since "@$since" -o cat | grep 'table records of the previous agent taken' | grep -o 'tables=[0-9]*' | tail -n 1 | cut -d= -f2)"
echo "records=$(journalctl -u vmnet -q --since "@$since" -o cat | grep -i 'table records' | tr '\n' '|')"
echo "ping:"
cat /run/pkgvm/ping.log
"#,
        peer = super::package_vm::UPLINK_PEER
    );
    let out = g.sh(&script, 420)?;
    let m = kv(&out);
    let pair = |k: &str| -> (String, String) {
        let v = get(&m, k);
        let (a, b) = v.split_once(" → ").unwrap_or((v, ""));
        (a.to_owned(), b.to_owned())
    };
    let (old, new) = pair("pids");
    let (n0, n1) = pair("nrestarts");
    let delta = n1.parse::<i64>().unwrap_or(-1) - n0.parse::<i64>().unwrap_or(0);
    let watchdog = get(&m, "watchdog").parse::<u32>().unwrap_or(0);
    let secs = get(&m, "restart_ms").parse::<f64>().unwrap_or(0.0) / 1000.0;
    // A stop and start (the package's restart) sets NRestarts back to 0: only systemd's own
    // restarts count there.
    let counted = restarts > 0;
    let mut restarted =
        new != old && new != "0" && get(&m, "ready") == "200" && (!counted || delta == restarts);
    let mut expected = if counted {
        format!("a new agent, ready; NRestarts +{restarts}")
    } else {
        "a new agent, ready".to_owned()
    };
    let mut seen = format!(
        "pid {old} → {new}, /readyz {} after {secs:.1} s",
        get(&m, "ready")
    );
    if counted {
        seen.push_str(&format!("; NRestarts {n0} → {n1}"));
    }
    if matches!(d, Disruption::Stop) {
        restarted &= watchdog > 0;
        expected.push_str("; watchdog timeout");
        seen.push_str(&format!("; {watchdog} watchdog timeout"));
    }
    if let Some(r) = m.get("reinstall") {
        restarted = false;
        seen = format!("reinstall {r}");
    }
    let (ns0, ns1) = pair("netns");
    let (tap0, tap1) = pair("tap");
    let same = ns0 == ns1 && tap0 == tap1 && !ns0.is_empty() && !tap0.is_empty();
    let ping = ping_loss(&out);
    let mut checks = vec![judged(
        &format!("{what}: systemd restarts it"),
        &expected,
        seen,
        restarted,
    )];
    if matches!(d, Disruption::Reinstall) {
        // A stop by systemd (SIGTERM) hands the VM's table record to the next agent, which
        // does not list the table (nothing committed in the netns since).
        let taken = get(&m, "taken");
        checks.push(judged(
            &format!("{what}: the new agent takes the VM table's record"),
            "1 table taken (not listed)",
            if taken.is_empty() {
                format!("none taken; its journal: {}", get(&m, "records"))
            } else {
                format!("{taken} table taken (not listed)")
            },
            taken == "1",
        ));
    }
    checks.extend([
        judged(
            &format!("{what}: the VM's netns and tap"),
            "the same objects",
            if same {
                format!("the same objects (netns inode {ns0}, tap ifindex {tap0})")
            } else {
                format!("netns inode {ns0} → {ns1}, tap ifindex {tap0} → {tap1}")
            },
            same,
        ),
        judged(
            &format!("{what}: guest → 192.0.2.1 ping every 50 ms through the tap"),
            "0 lost",
            ping.0,
            ping.1,
        ),
    ]);
    Ok(checks)
}

/// From ping's output: `N lost of M` and whether none was lost. Every request but the last
/// (which may be in flight when ping is stopped) must have had its reply.
fn ping_loss(out: &str) -> (String, bool) {
    let sent = out
        .lines()
        .find_map(|l| l.split_once(" packets transmitted"))
        .and_then(|(n, _)| n.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let answered: std::collections::BTreeSet<u64> = out
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.split("icmp_seq=").nth(1))
        .filter_map(|s| s.split_whitespace().next()?.parse().ok())
        .collect();
    let lost = (1..sent).filter(|s| !answered.contains(s)).count();
    (format!("{lost} lost of {sent}"), sent >= 40 && lost == 0)
}

#[cfg(test)]
mod tests {
    use super::ping_loss;

    fn ping(sent: u64, missing: &[u64]) -> String {
        let mut out: String = (1..=sent)
            .filter(|s| !missing.contains(s))
            .map(|s| format!("64 bytes from 192.0.2.1: icmp_seq={s} ttl=63 time=1.2 ms\n"))
            .collect();
        out.push_str(&format!("{sent} packets transmitted, … received\n"));
        out
    }

    #[test]
    fn ping_loss_counts_unanswered_requests_but_the_last() {
        assert_eq!(ping_loss(&ping(51, &[7])), ("1 lost of 51".into(), false));
        assert_eq!(ping_loss(&ping(51, &[51])), ("0 lost of 51".into(), true));
        assert_eq!(ping_loss(&ping(10, &[])), ("0 lost of 10".into(), false));
        assert_eq!(ping_loss(""), ("0 lost of 0".into(), false));
    }
}
