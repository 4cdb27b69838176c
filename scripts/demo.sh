#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine, as root: builds vmnet (the product) and vmnet-lab
# (the sandbox), brings up a sandbox host namespace (uplink to a fake internet namespace) running
# the agent (`vmnet serve`) with the embedded SQLite store, applies examples/host.json, attaches
# simulated guests and prints the checks.
# `vmnet-lab down --sandbox` (run by this script at the end unless KEEP=1) removes all of it, but
# only when this run made it: a sandbox that existed already (`up` exits 4, CONFLICT) is left
# alone. NAME=... picks the sandbox name (`--name`, default vmsbx).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "scripts/demo.sh must run as root" >&2; exit 1; }

scripts/install-deps.sh
cargo build --release --locked -p vmnet -p vmnet-lab
# vmnet-lab runs the agent from the vmnet binary beside it.
lab="${CARGO_TARGET_DIR:-target}/release/vmnet-lab"

name="${NAME:-vmsbx}"
status=0
"$lab" up --sandbox "${1:-examples/host.json}" --name "$name" || status=$?
if [ "${KEEP:-0}" != 1 ] && [ "$status" != 4 ]; then
  # Exit 3 (NOT_FOUND): `up` failed before building anything or removed its partial sandbox.
  # `vmnet-lab up` leaves its sandbox up; the demo takes it down unless KEEP=1.
  echo "demo: \`vmnet-lab up\` left sandbox $name up (as it always does); the demo takes it down now (KEEP=1 scripts/demo.sh keeps it)"
  down=0
  "$lab" down --sandbox --name "$name" || down=$?
  if [ "$down" != 0 ] && [ "$down" != 3 ] && [ "$status" = 0 ]; then
    status=$down
  fi
  [ "$down" = 0 ] && echo "demo: sandbox $name removed after its checks (KEEP=1 scripts/demo.sh keeps it up)"
fi
exit "$status"
