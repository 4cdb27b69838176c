#!/usr/bin/env bash
# Installs the Debian packages vmnet's main job and test suite need on a fresh Debian 12 machine.
# Idempotent; needs root. The Rust toolchain is expected to be present already.
set -euo pipefail

packages=(
  iproute2 nftables util-linux procps kmod
  wireguard-go wireguard-tools  # wg0 without a kernel module; `wg` for tests and debugging
  iperf3  # the throughput-limit tests and the sandbox's limit check measure with it
  iputils-ping tcpdump  # trying a kept sandbox by hand, as the lab page shows
  postgresql
  genisoimage dosfstools mtools
  clang libbpf-dev linux-libc-dev
  prometheus  # promtool: the metrics tests check every scrape with `promtool check metrics`
  libvirt-clients  # virsh: the tests validate the generated libvirt XML with libvirt itself
  mmdebstrap qemu-system-x86 qemu-utils  # real guests: scripts/guest-image.sh and --guests kvm
  python3 python3-yaml python3-jinja2 python3-jsonschema python3-configobj
  python3-requests python3-jsonpatch python3-netifaces
)

missing_packages() {
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
}

# Two passes: installing one package can make apt remove another that conflicts with it (a
# machine image with qemu-utils from backports loses it to Debian's qemu-system-x86), and the
# second pass installs the matching version.
export DEBIAN_FRONTEND=noninteractive
updated=0
for pass in 1 2; do
  missing_packages
  ((${#missing[@]})) || break
  echo "installing (pass $pass): ${missing[*]}"
  if ((!updated)); then apt-get update -q && updated=1; fi
  apt-get install -y -q --no-install-recommends "${missing[@]}"
done

# The agent's unprivileged worker (the metadata service and the provider polls) runs as a user
# of its own: `vmnet serve --worker-user`, default vmnet-worker.
if ! getent passwd vmnet-worker >/dev/null; then
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin --comment "vmnet unprivileged worker" vmnet-worker
fi

# Debian's postgresql package tries to start a system cluster; vmnet never uses it (tests start
# their own cluster on a unix socket). Nothing else to start here.
for tool in ip nft tc clang wireguard-go wg iperf3 promtool mmdebstrap qemu-system-x86_64 qemu-img; do
  command -v "$tool" >/dev/null || { echo "missing $tool after install" >&2; exit 1; }
done
ls /usr/lib/postgresql/*/bin/initdb >/dev/null
