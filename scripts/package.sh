#!/usr/bin/env bash
# Builds the Debian packages of vmnet with dpkg-deb, Debian's own packaging tool:
#   vmnet_VERSION_amd64.deb        what a hypervisor host installs: vmnet, vmnetd and
#                                  vmnet-pool-helper in /usr/bin, the systemd unit, the default
#                                  configuration /etc/vmnet/vmnet.toml (a conffile), manual
#                                  pages and bash, zsh and fish completions;
#   vmnet-guest_VERSION_amd64.deb  what a VM image installs: vmnet-guest and its unit.
#
# Usage: scripts/package.sh [--debug] [--no-build] [--out DIR]
#   --debug     package the debug build instead of a release build, fast-compressed (tests)
#   --no-build  package the binaries already built (the test suite builds them first)
#   --out DIR   where the .deb files go (default: target/debian)
# Prints the path of each package. Needs dpkg-deb (any Debian); root is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release out= build=1
while (($#)); do
  case "$1" in
    --debug) profile=debug ;;
    --no-build) build=0 ;;
    --out) out=$2; shift ;;
    *) echo "package.sh: unknown argument $1 (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
  shift
done
target="${CARGO_TARGET_DIR:-target}"
out="${out:-$target/debian}"
bin="$target/$profile"
if ((build)); then
  flag=()
  [ "$profile" = release ] && flag=(--release)
  cargo build "${flag[@]}" --locked -p vmnet -p vmnet-agent -p vmnet-guest
  # The client, `vmnet`, is linked statically and at a fixed address: orchestrators run it once
  # per VM, and such an executable starts without the dynamic loader and without relocating
  # itself (about 0.3 ms less on every command). It calls nothing of glibc that needs the
  # dynamic name service, so the link warns of nothing. Its address is fixed as a Go program's
  # is: it runs briefly, reads only the caller's file and the agent's answers, and holds no
  # secret.
  cargo rustc "${flag[@]}" --locked -p vmnet --bin vmnet -- \
    -C target-feature=+crt-static -C relocation-model=static
fi
compress=()
[ "$profile" = debug ] && compress=(-Zgzip -z1)

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- vmnet ---------------------------------------------------------------------------------
root="$work/vmnet"
install -d "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/vmnet" \
  "$root/usr/share/man/man1" "$root/usr/share/doc/vmnet" \
  "$root/usr/share/bash-completion/completions" "$root/usr/share/zsh/vendor-completions" \
  "$root/usr/share/fish/vendor_completions.d"
for b in vmnet vmnetd vmnet-pool-helper; do
  install -m 0755 "$bin/$b" "$root/usr/bin/$b"
done
[ "$profile" = release ] && strip "$root"/usr/bin/*
# The unit runs the packaged binary (the repository's copy names /usr/local/bin for hosts
# that install from source).
sed 's|/usr/local/bin/|/usr/bin/|g' packaging/vmnet.service >"$root/lib/systemd/system/vmnet.service"
install -m 0644 examples/vmnet.toml "$root/etc/vmnet/vmnet.toml"
"$bin/vmnet" man --dir "$root/usr/share/man/man1" >/dev/null
gzip -9n "$root"/usr/share/man/man1/*.1
"$bin/vmnet" completions bash >"$root/usr/share/bash-completion/completions/vmnet"
"$bin/vmnet" completions zsh >"$root/usr/share/zsh/vendor-completions/_vmnet"
"$bin/vmnet" completions fish >"$root/usr/share/fish/vendor_completions.d/vmnet.fish"
cat >"$root/usr/share/doc/vmnet/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vmnet
License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.
EOF
echo /etc/vmnet/vmnet.toml >"$root/DEBIAN/conffiles"
size=$(du -sk "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<EOF
Package: vmnet
Version: $version
Architecture: $arch
Maintainer: vmnet developers <vmnet@localhost>
Installed-Size: $size
Depends: libc6 (>= 2.36), libnftables1, nftables, iproute2, adduser
Recommends: wireguard-go, wireguard-tools
Section: net
Priority: optional
Description: host networking for virtual machines
 One agent per hypervisor host gives each VM its network and keeps it true:
 namespace mode (a network namespace per VM with NAT, public addresses, limits,
 a firewall, a WireGuard mesh, metadata and packet activity) and pool mode
 (IPAM in SQL, taps on a bridge, cloud-init seeds, anti-spoofing tables).
EOF
# The worker's user; the unit is enabled but not started on a first install (the operator
# sets /etc/vmnet/vmnet.toml first); an upgrade restarts a running agent, which adopts the
# kernel state it finds, so VMs keep their traffic.
cat >"$root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  if ! getent passwd vmnet-worker >/dev/null; then
    adduser --system --group --no-create-home --home /nonexistent \
      --gecos "vmnet unprivileged worker" vmnet-worker >/dev/null
  fi
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if [ -z "$2" ]; then
      systemctl enable vmnet.service >/dev/null 2>&1 || true
    else
      systemctl try-restart vmnet.service || true
    fi
  fi
fi
EOF
cat >"$root/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
# Only a removal stops the agent; an upgrade keeps it running until postinst restarts it.
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
  systemctl disable --now vmnet.service >/dev/null 2>&1 || true
fi
EOF
chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm"
dpkg-deb --root-owner-group "${compress[@]}" --build "$root" "$out/vmnet_${version}_${arch}.deb" >/dev/null
echo "$out/vmnet_${version}_${arch}.deb"

# --- vmnet-guest ---------------------------------------------------------------------------
groot="$work/vmnet-guest"
install -d "$groot/DEBIAN" "$groot/usr/bin" "$groot/lib/systemd/system" "$groot/usr/share/doc/vmnet-guest"
install -m 0755 "$bin/vmnet-guest" "$groot/usr/bin/vmnet-guest"
[ "$profile" = release ] && strip "$groot/usr/bin/vmnet-guest"
sed 's|/usr/local/bin/|/usr/bin/|g' crates/vmnet-guest/vmnet-guest.service \
  >"$groot/lib/systemd/system/vmnet-guest.service"
cp "$root/usr/share/doc/vmnet/copyright" "$groot/usr/share/doc/vmnet-guest/copyright"
cat >"$groot/DEBIAN/control" <<EOF
Package: vmnet-guest
Version: $version
Architecture: $arch
Maintainer: vmnet developers <vmnet@localhost>
Installed-Size: $(du -sk "$groot" | cut -f1)
Depends: libc6 (>= 2.36), iproute2
Section: net
Priority: optional
Description: guest agent for VMs networked by vmnet
 Reads the VM's mesh address and host routes from vmnet's metadata service and
 applies them in the guest (namespace mode).
EOF
cat >"$groot/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  [ -z "$2" ] && systemctl enable vmnet-guest.service >/dev/null 2>&1 || true
fi
EOF
chmod 0755 "$groot/DEBIAN/postinst"
dpkg-deb --root-owner-group "${compress[@]}" --build "$groot" "$out/vmnet-guest_${version}_${arch}.deb" >/dev/null
echo "$out/vmnet-guest_${version}_${arch}.deb"
