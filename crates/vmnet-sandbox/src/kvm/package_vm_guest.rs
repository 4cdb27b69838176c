//! The steps of `vmnet-lab package-vm` ([`super::package_vm`]), each a bash script run inside
//! the VM over the command channel, and the checks read from what it printed.
//!
//! | step | what it does in the VM | checks |
//! | --- | --- | --- |
//! | install | mounts the package disk, `apt-get install ./vmnet_*.deb` (offline) | installed, unit enabled, not started |
//! | configure | `metrics-listen` added to `/etc/vmnet/vmnet.toml`, `vmnet config check` | ok; the unit as shipped (`WatchdogSec=30s`) |
//! | start | `systemctl start vmnet`, then at once `GET /readyz` | 200 as `start` returns; `active (running)` |
//! | put | `vmnet events --follow` in the background, `vmnet vm put vm.json` | the VM's netns, both veth ends and the tap, named as documented |
//! | guest | a guest namespace (`172.16.0.2`, the guest MAC) joined to the VM's tap by a small Python relay that opens the tap as a VMM does; a ping through the tap, the VM's NAT and the host's masquerade to the far end of the VM's uplink | reaches it; the guest reads its metadata |
//! | drift | the tap's MTU changed by hand | put back; the follower saw the PUT and the repair |
//! | prometheus | Debian's `prometheus` scrapes `--metrics-listen` every 2 s; its query API; `promtool check metrics` on a scrape | the VM count 1; no problems; the listener refuses the API |
//! | kill -9, SIGSTOP, reinstall | each while the guest pings every 50 ms: the agent killed, the agent stopped (the watchdog restarts it), `apt-get install --reinstall` | a new ready agent, the netns and tap the same objects, no ping lost |
//! | journal | `journalctl -u vmnet -o json VM=…` | the VM id and the operation as fields |

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::package_vm_restarts::{Disruption, disrupt};
use super::{Accel, Channel};
use crate::pool_job::checks::{Check, check};

/// The VM put through the packaged CLI, and the names the docs give its objects (prefix `vmn`,
/// user id 7).
const VM_ID: &str = "pkgvm-7";
const VM_JSON: &str = r#"{"id": "pkgvm-7", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:7::7", "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}"#;
pub(super) const NETNS: &str = "vmnn0007";
pub(super) const TAP: &str = "vmnt0007";
const VETH_VM: &str = "vmnp0007";
const VETH_HOST: &str = "vmnh0007";

/// The relay joining the guest to the VM's tap: it opens the VM's tap inside the VM's netns as a
/// VMM does, and the guest namespace's `eth0` (a tap too, so the guest's kernel computes every
/// checksum itself), and copies frames both ways.
const RELAY_PY: &str = r#"import ctypes, fcntl, os, struct, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def tap(ns, name):
    fd = os.open("/run/netns/" + ns, os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns " + ns)
    os.close(fd)
    t = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(t, 0x400454CA, struct.pack("16sH", name.encode(), 0x0002 | 0x1000))
    return t
vm = tap(sys.argv[1], sys.argv[2])
guest = tap(sys.argv[3], sys.argv[4])
def copy(a, b):
    while True:
        os.write(b, os.read(a, 65535))
threading.Thread(target=copy, args=(guest, vm), daemon=True).start()
copy(vm, guest)
"#;

/// The VM seen from here: its command channel and the package's file name on `/mnt/pkg`.
pub struct Guest {
    ch: Channel,
    pub(super) deb: String,
}

impl Guest {
    /// A guest answering on `ch`, with the package `deb` (a file name) on its package disk.
    #[must_use]
    pub fn new(ch: Channel, deb: String) -> Self {
        Self { ch, deb }
    }

    /// Runs `script`; its output, or why it failed (status and output).
    pub(super) fn sh(&mut self, script: &str, secs: u64) -> Result<String, String> {
        match self.ch.run(script, Duration::from_secs(secs)) {
            Ok(r) if r.status == 0 => Ok(r.output),
            Ok(r) => Err(format!(
                "exit {}{}: {}",
                r.status,
                if r.status == 124 { " (timed out)" } else { "" },
                tail(&r.output, 12)
            )),
            Err(e) => Err(format!("command channel: {e}")),
        }
    }

    /// The agent's unit status and last log lines, for a failed run.
    #[must_use]
    pub fn diagnostics(&mut self) -> String {
        let script = "systemctl status vmnet --no-pager -n 0; journalctl -u vmnet --no-pager -n 25; \
                      ip -br link; ip netns list";
        match self.ch.run(script, Duration::from_secs(60)) {
            Ok(r) => format!(
                "package-vm: the VM's state after the failure:\n{}",
                r.output
            ),
            Err(e) => format!("package-vm: no diagnostics from the VM: {e}"),
        }
    }
}

/// The last `n` lines of `s`, joined by ` | `.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// `key=value` lines of a step's output.
pub(super) fn kv(out: &str) -> HashMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

pub(super) fn get<'a>(m: &'a HashMap<String, String>, k: &str) -> &'a str {
    m.get(k).map_or("", String::as_str)
}

/// A check whose verdict is `ok` (the seen text carries more than the expected one).
pub(super) fn judged(name: &str, expected: &str, seen: String, ok: bool) -> Check {
    Check {
        name: name.into(),
        expected: expected.into(),
        seen,
        ok,
    }
}

type Step = fn(&mut Guest) -> Result<Vec<Check>, String>;

/// Every step in order, after the boot's check; a step that cannot run ends the list with a
/// failed check naming it.
pub fn run_all(g: &mut Guest, boot: Duration, accel: Accel) -> Vec<Check> {
    let mut checks = vec![check(
        "boot: the Debian 12 VM answers on its command channel",
        "answers",
        "answers",
    )];
    checks[0].seen = format!(
        "answers after {:.1} s ({})",
        boot.as_secs_f64(),
        if accel == Accel::Kvm { "KVM" } else { "TCG" }
    );
    let steps: [(&str, Step); 11] = [
        ("install", install),
        ("configure", configure),
        ("start", start),
        ("put", put),
        ("guest", guest),
        ("drift", drift),
        ("prometheus", prometheus),
        ("kill -9", |g| disrupt(g, Disruption::Kill)),
        ("SIGSTOP", |g| disrupt(g, Disruption::Stop)),
        ("reinstall", |g| disrupt(g, Disruption::Reinstall)),
        ("journal", journal),
    ];
    for (name, step) in steps {
        match step(g) {
            Ok(c) => checks.extend(c),
            Err(e) => {
                checks.push(judged(&format!("step {name}"), "runs", e, false));
                break;
            }
        }
    }
    checks
}

fn install(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!(
        r#"set -e
mkdir -p /mnt/pkg /run/pkgvm
mountpoint -q /mnt/pkg || mount -o ro,noload /dev/vdb /mnt/pkg
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q -o Dpkg::Use-Pty=0 /mnt/pkg/{deb} >/run/pkgvm/install.log 2>&1 || {{ tail -n 20 /run/pkgvm/install.log; exit 1; }}
echo "status=$(dpkg-query -W -f='${{Status}} ${{Version}}' vmnet)"
echo "enabled=$(systemctl is-enabled vmnet)"
echo "active=$(systemctl is-active vmnet)"
echo "worker=$(getent passwd vmnet-worker | cut -d: -f1)"
"#,
        deb = g.deb
    );
    let m = kv(&g.sh(&script, 900)?);
    let seen = format!(
        "{}; unit {}, {}; user {}",
        get(&m, "status"),
        get(&m, "enabled"),
        get(&m, "active"),
        get(&m, "worker")
    );
    let ok = get(&m, "status").starts_with("install ok installed")
        && get(&m, "enabled") == "enabled"
        && get(&m, "active") == "inactive"
        && get(&m, "worker") == "vmnet-worker";
    Ok(vec![judged(
        &format!(
            "apt-get install ./{} (offline: Depends from the image)",
            g.deb
        ),
        "installed; unit enabled, inactive; user vmnet-worker",
        seen,
        ok,
    )])
}

fn configure(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = r#"set -e
cat >>/etc/vmnet/vmnet.toml <<'EOF'

# vmnet-lab package-vm: the Prometheus server scrapes this listener.
metrics-listen = "127.0.0.1:9851"
EOF
vmnet config check --config /etc/vmnet/vmnet.toml | grep -E '^ *metrics-listen' | head -n 1
echo "watchdog=$(systemctl cat vmnet | sed -n 's/^WatchdogSec=//p' | tail -n 1)"
"#;
    let out = g.sh(script, 120)?;
    let m = kv(&out);
    let listen = out.lines().next().unwrap_or("").to_owned();
    Ok(vec![judged(
        "vmnet config check of /etc/vmnet/vmnet.toml with metrics-listen",
        "metrics-listen 127.0.0.1:9851; the unit's WatchdogSec 30s",
        format!(
            "{}; WatchdogSec {}",
            listen.split_whitespace().collect::<Vec<_>>().join(" "),
            get(&m, "watchdog")
        ),
        listen.contains("127.0.0.1:9851") && get(&m, "watchdog") == "30s",
    )])
}

pub(super) const READYZ: &str = "curl -s -o /dev/null -w '%{http_code}' --unix-socket /run/vmnet/vmnet.sock http://vmnet/readyz";

fn start(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!(
        r#"t0=$(date +%s%N)
systemctl start vmnet; echo "rc=$?"
t1=$(date +%s%N)
echo "readyz=$({READYZ})"
echo "start_ms=$(( (t1 - t0) / 1000000 ))"
systemctl show -p ActiveState -p SubState -p StatusText vmnet
"#
    );
    let m = kv(&g.sh(&script, 600)?);
    let secs = get(&m, "start_ms").parse::<f64>().unwrap_or(0.0) / 1000.0;
    let state = format!("{} ({})", get(&m, "ActiveState"), get(&m, "SubState"));
    Ok(vec![
        judged(
            "systemctl start vmnet returns only once the agent is ready",
            "GET /readyz 200 as it returns",
            format!(
                "GET /readyz {} as it returns (after {secs:.1} s)",
                get(&m, "readyz")
            ),
            get(&m, "rc") == "0" && get(&m, "readyz") == "200",
        ),
        judged(
            "systemctl status vmnet",
            "active (running)",
            format!("{state}: {}", get(&m, "StatusText")),
            state == "active (running)",
        ),
    ])
}

fn put(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!(
        r#"set -e
setsid vmnet --output json events --follow --since 0 >/run/pkgvm/events.ndjson 2>&1 </dev/null &
cat >/run/pkgvm/vm.json <<'EOF'
{VM_JSON}
EOF
vmnet vm put /run/pkgvm/vm.json >/run/pkgvm/put.out 2>&1 || {{ cat /run/pkgvm/put.out; exit 1; }}
echo "netns=$(ip netns list | awk '$1 == "{NETNS}" {{print $1}}')"
echo "links=$(ip -n {NETNS} -o link show | awk -F': ' '{{print $2}}' | cut -d@ -f1 | grep -v '^lo$' | sort | xargs)"
echo "host=$(ip -o link show {VETH_HOST} | awk -F': ' '{{print $2}}' | cut -d@ -f1)"
"#
    );
    let m = kv(&g.sh(&script, 300)?);
    let want = format!("netns {NETNS} with {VETH_VM} {TAP}; host end {VETH_HOST}");
    let seen = format!(
        "netns {} with {}; host end {}",
        get(&m, "netns"),
        get(&m, "links"),
        get(&m, "host")
    );
    Ok(vec![check(
        "vmnet vm put vm.json: the VM's namespace, veth pair and tap",
        want,
        seen,
    )])
}

fn guest(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!(
        r#"set -e
cat >/run/pkgvm/relay.py <<'EOF'
{RELAY_PY}EOF
ip netns add pkgg
ip netns exec pkgg sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
ip -n pkgg tuntap add dev eth0 mode tap
ip -n pkgg link set eth0 address 06:00:ac:10:00:02 mtu 1380 up
ip -n pkgg link set lo up
ip -n pkgg addr add 172.16.0.2/30 dev eth0
ip -n pkgg route add default via 172.16.0.1
setsid python3 /run/pkgvm/relay.py {NETNS} {TAP} pkgg eth0 >/run/pkgvm/relay.log 2>&1 </dev/null &
set +e
reach=no
for i in $(seq 1 60); do
  ip netns exec pkgg ping -n -c 1 -W 1 {peer} >/dev/null 2>&1 && {{ reach=yes; echo reach=yes; break; }}
done
[ "$reach" = yes ] || {{ echo reach=no; cat /run/pkgvm/relay.log; ip -n {NETNS} -br link; exit 1; }}
mmds=http://169.254.169.254
for i in $(seq 1 10); do
  token=$(ip netns exec pkgg curl -sS -m 5 -X PUT -H 'X-metadata-token-ttl-seconds: 60' $mmds/latest/api/token 2>&1)
  id=$(ip netns exec pkgg curl -sS -m 5 -H "X-metadata-token: $token" $mmds/latest/meta-data/instance-id 2>&1)
  [ "$id" = {VM_ID} ] && break
  sleep 1
done
echo "metadata=$id"
[ "$id" = {VM_ID} ] || {{ echo "token=$token"; journalctl -u vmnet --no-pager -q | grep -i metadata | tail -n 5; }}
"#,
        peer = super::package_vm::UPLINK_PEER
    );
    let out = g.sh(&script, 300)?;
    let m = kv(&out);
    let reached = get(&m, "reach") == "yes";
    Ok(vec![
        judged(
            "the guest reads its metadata (GET /latest/meta-data/instance-id, v2 token)",
            VM_ID,
            if get(&m, "metadata") == VM_ID {
                VM_ID.to_owned()
            } else {
                tail(&out, 8)
            },
            get(&m, "metadata") == VM_ID,
        ),
        judged(
            "a guest on the VM's tap (Python relay) pings the uplink's far end through NAT",
            "reaches 192.0.2.1",
            if reached {
                "reaches 192.0.2.1".into()
            } else {
                out
            },
            reached,
        ),
    ])
}

fn drift(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!(
        r#"mtu() {{ ip -n {NETNS} -o link show {TAP} | grep -o 'mtu [0-9]*' | cut -d' ' -f2; }}
before=$(mtu)
ip -n {NETNS} link set {TAP} mtu 1280
for i in $(seq 1 100); do now=$(mtu); [ "$now" = "$before" ] && break; sleep 0.1; done
sleep 1
echo "before=$before"
echo "after=$now"
echo "events:"
cat /run/pkgvm/events.ndjson
"#
    );
    let out = g.sh(&script, 120)?;
    let m = kv(&out);
    let events: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["vm"] == VM_ID)
        .collect();
    let find = |kind: &str| events.iter().find(|e| e["kind"] == kind);
    let applied = find("vm_applied").map_or_else(
        || "none".to_owned(),
        |e| format!("vm_applied change={} trigger={}", e["change"], e["trigger"]).replace('"', ""),
    );
    let repaired = find("drift_repaired").map_or_else(
        || "none".to_owned(),
        |e| {
            format!(
                "drift_repaired objects={} trigger={}",
                e["objects"], e["trigger"]
            )
            .replace('"', "")
        },
    );
    Ok(vec![
        judged(
            "drift: the tap's MTU set to 1280 by hand",
            "put back",
            format!("{} → 1280 → {}", get(&m, "before"), get(&m, "after")),
            !get(&m, "before").is_empty() && get(&m, "before") == get(&m, "after"),
        ),
        check(
            "vmnet events --follow: the PUT",
            "vm_applied change=created trigger=api",
            applied,
        ),
        judged(
            "vmnet events --follow: the drift repair",
            "drift_repaired objects=[link]",
            repaired.clone(),
            repaired.starts_with("drift_repaired objects=[link"),
        ),
    ])
}

fn prometheus(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = r#"cat >/etc/prometheus/prometheus.yml <<'EOF'
global:
  scrape_interval: 2s
scrape_configs:
  - job_name: vmnet
    static_configs:
      - targets: ['127.0.0.1:9851']
EOF
systemctl restart prometheus || exit 1
end=$((SECONDS + 300))
while [ $SECONDS -lt $end ]; do
  a=$(curl -s --get --data-urlencode 'query=sum(vmnet_vms{state="applied"})' http://127.0.0.1:9090/api/v1/query)
  case "$a" in *'"result":[{'*) break ;; esac
  sleep 1
done
echo "answer=$a"
echo "version=$(prometheus --version 2>&1 | head -n 1)"
curl -s http://127.0.0.1:9851/metrics >/run/pkgvm/metrics.txt
promtool check metrics </run/pkgvm/metrics.txt >/run/pkgvm/promtool.txt 2>&1
echo "promtool=$? $(head -c 300 /run/pkgvm/promtool.txt | tr '\n' ' ')"
echo "series=$(grep -c '^vmnet_' /run/pkgvm/metrics.txt)"
echo "api=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:9851/v1/vms)"
"#;
    let m = kv(&g.sh(script, 420)?);
    let answer: Value = serde_json::from_str(get(&m, "answer")).unwrap_or_default();
    let count = answer["data"]["result"][0]["value"][1]
        .as_str()
        .unwrap_or("no answer")
        .to_owned();
    let version = get(&m, "version")
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    let promtool = get(&m, "promtool");
    Ok(vec![
        judged(
            "Prometheus scrapes --metrics-listen: query sum(vmnet_vms{state=\"applied\"})",
            "1",
            format!("{count} ({version})"),
            count == "1",
        ),
        judged(
            "promtool check metrics on the scrape",
            "no problems",
            if promtool.trim() == "0" {
                format!("no problems ({} series)", get(&m, "series"))
            } else {
                promtool.to_owned()
            },
            promtool.trim() == "0",
        ),
        check(
            "--metrics-listen serves metrics only: GET /v1/vms",
            "404",
            get(&m, "api"),
        ),
    ])
}

fn journal(g: &mut Guest) -> Result<Vec<Check>, String> {
    let script = format!("journalctl -u vmnet -o json --no-pager VM={VM_ID} | tail -n 200");
    let out = g.sh(&script, 120)?;
    let mut ops: Vec<String> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["VM"] == VM_ID)
        .filter_map(|e| e["OP"].as_str().map(str::to_owned))
        .collect();
    ops.sort();
    ops.dedup();
    Ok(vec![judged(
        "journalctl -u vmnet -o json: the VM id and the operation as fields",
        &format!("VM={VM_ID} OP=create"),
        format!("VM={VM_ID} OP={}", ops.join(",")),
        ops.iter().any(|o| o == "create"),
    )])
}
