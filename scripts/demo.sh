#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine, as root: builds vmnet, brings up a sandbox host
# namespace (uplink to a fake internet namespace) running the agent with the embedded SQLite
# store, applies examples/host.json, attaches simulated guests and prints the checks.
# `vmnet down --sandbox` (run by this script at the end unless KEEP=1) removes all of it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "scripts/demo.sh must run as root" >&2; exit 1; }

scripts/install-deps.sh
cargo build --release --locked -p vmnet
bin=target/release/vmnet

status=0
"$bin" up --sandbox "${1:-examples/host.json}" || status=$?
if [ "${KEEP:-0}" != 1 ]; then
  "$bin" down --sandbox
fi
exit "$status"
