#!/usr/bin/env bash
# Builds the real guest for `vmnet-lab up --sandbox --guests kvm` and the KVM tests from Debian
# packages only: the kernel of linux-image-cloud-amd64 (vmlinuz + initrd) and a raw ext4 root
# file system made by mmdebstrap (systemd, systemd-networkd, cloud-init, iproute2, iperf3,
# python3 for the raw-frame spoof checks, the vmnet-guest binary and unit, the command channel).
#
# Usage: scripts/guest-image.sh [VMNET_GUEST_BINARY]   (as root; prints the image directory)
#        scripts/guest-image.sh --host
#
# `--host` builds the second image instead: a hypervisor host for `vmnet-lab package-vm`, which
# installs the vmnet package in it as an operator would. It holds what the package depends on and
# what the check uses (nftables, libnftables1, adduser, iproute2, wireguard-go and
# wireguard-tools, Debian's prometheus, iputils-ping, curl, python3), no cloud-init and no vmnet
# binary: the package is handed to the VM when it runs. Its eth0 (MAC 06:00:c0:00:02:02) is
# 192.0.2.2/24 via 192.0.2.1. It is cached under $VMNET_GUEST_CACHE/host, keyed as below
# without a binary, and pruned there the same way.
#
# The image is cached in $VMNET_GUEST_CACHE (default /var/cache/vmnet-guest) under a directory
# named by a hash of: the package list, the candidate version of each listed package (apt's
# view of bookworm), this script, and the vmnet-guest binary. A second run with the same inputs
# only prints the directory. Guests never write the cached files: each VM boots from its own
# qcow2 overlay (see crates/vmnet-sandbox/src/kvm). Each distinct vmnet-guest build makes an
# image of about 450 MB, so the cache keeps only the $VMNET_GUEST_KEEP (default 4) most recently
# used ones (a run touches the image it uses) and removes older image directories.
#
# Layout of the image directory: vmlinuz, initrd.img, rootfs.raw (ext4, label vmroot),
# packages.txt (every installed package and version), build.txt (build seconds and sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "scripts/guest-image.sh must run as root" >&2; exit 1; }

variant=guest
if [ "${1:-}" = --host ]; then variant=host; shift; fi
guest_bin="${1:-}"
if [ "$variant" = host ]; then
  guest_bin=/dev/null
elif [ -z "$guest_bin" ]; then
  for c in "${CARGO_TARGET_DIR:-target}"/release/vmnet-guest "${CARGO_TARGET_DIR:-target}"/debug/vmnet-guest; do
    [ -x "$c" ] && { guest_bin=$c; break; }
  done
fi
[ "$variant" = host ] || [ -x "$guest_bin" ] || { echo "guest-image: no vmnet-guest binary (cargo build -p vmnet-guest)" >&2; exit 1; }

packages=(
  systemd systemd-sysv systemd-resolved udev dbus
  linux-image-cloud-amd64 initramfs-tools
  cloud-init iproute2 iperf3 iputils-ping netbase procps systemd-timesyncd
  python3
)
cache="${VMNET_GUEST_CACHE:-/var/cache/vmnet-guest}"
if [ "$variant" = host ]; then
  packages=(
    systemd systemd-sysv udev dbus
    linux-image-cloud-amd64 initramfs-tools
    iproute2 iputils-ping netbase procps curl python3
    nftables libnftables1 adduser wireguard-go wireguard-tools prometheus
  )
  cache="$cache/host"
fi
mkdir -p "$cache"

# The binary is keyed stripped: a rebuild that changes only debug info reuses the image.
stripped=$(mktemp)
trap 'rm -f "$stripped"' EXIT
if [ "$variant" = guest ]; then
  strip -o "$stripped" "$guest_bin" 2>/dev/null || cp "$guest_bin" "$stripped"
fi

versions=$(apt-cache policy "${packages[@]}" | awk '/^[^ ]/ {p=$1} /Candidate:/ {print p, $2}')
key=$(
  {
    echo "$variant"
    printf '%s\n' "${packages[@]}"
    echo "$versions"
    sha256sum "$0" | cut -d' ' -f1
    sha256sum "$stripped" | cut -d' ' -f1
  } | sha256sum | cut -c1-16
)
out="$cache/$key"
keep="${VMNET_GUEST_KEEP:-4}"
[[ "$keep" =~ ^[1-9][0-9]*$ ]] || { echo "guest-image: VMNET_GUEST_KEEP must be a positive number" >&2; exit 1; }

# Removes every image directory (16 hex digits) but the $keep most recently used, never $out.
prune() {
  local d
  find "$cache" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended \
    -regex '.*/[0-9a-f]{16}' -printf '%T@ %p\n' | sort -rn | tail -n +"$((keep + 1))" |
    while read -r _ d; do
      [ "$d" = "$out" ] && continue
      echo "guest-image: removing the older image $d" >&2
      rm -rf "$d"
    done
}

if [ -f "$out/rootfs.raw" ] && [ -f "$out/build.txt" ]; then
  touch "$out"
  prune
  echo "$out"
  exit 0
fi

start=$(date +%s)
work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work" "$stripped"' EXIT
root="$work/root"
mkdir "$root"
cp "$stripped" "$work/vmnet-guest"

inc=$(IFS=,; echo "${packages[*]}")
# A failed bootstrap (a mirror caught mid-sync, a package script that fails once) is tried once
# more from scratch; each try's log is kept in the work directory, and a failure ends with the
# lines of it that say why (dpkg's and apt's errors), since callers show only the last lines.
bootstrap() {
  rm -rf "$root" && mkdir "$root"
  mmdebstrap --variant=minbase --include="$inc" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    bookworm "$root" http://deb.debian.org/debian >"$work/mmdebstrap-$1.log" 2>&1
}
for try in 1 2; do
  bootstrap "$try" && break
  cat "$work/mmdebstrap-$try.log" >&2
  echo "guest-image: mmdebstrap failed (try $try of 2); what failed:" >&2
  grep -E '^(E:|dpkg: error|dpkg: dependency)|returned error exit status|Errors were encountered|error processing|No space left' \
    "$work/mmdebstrap-$try.log" | grep -v '^E: mmdebstrap failed' | tail -n 8 | sed 's/^/  /' >&2 || true
  [ "$try" = 2 ] && exit 25
done

# --- the guest's configuration ------------------------------------------------------------
echo "vmnet-$variant" >"$root/etc/hostname"
echo 'LABEL=vmroot / ext4 rw,noatime 0 1' >"$root/etc/fstab"
passwd -R "$root" -d root >/dev/null
if [ "$variant" = host ]; then
  # The host: a fixed uplink address, nothing waits for the network, the command channel below.
  systemctl --root="$root" enable systemd-networkd.service >/dev/null 2>&1
  systemctl --root="$root" mask systemd-networkd-wait-online.service apt-daily.timer \
    apt-daily-upgrade.timer e2scrub_reap.service >/dev/null 2>&1 || true
  cat >"$root/etc/systemd/network/10-eth0.network" <<'EOF'
[Match]
MACAddress=06:00:c0:00:02:02

[Network]
Address=192.0.2.2/24
Gateway=192.0.2.1
IPv6AcceptRA=no
EOF
else
systemctl --root="$root" enable systemd-networkd.service systemd-resolved.service >/dev/null 2>&1
ln -sf /run/systemd/resolve/stub-resolv.conf "$root/etc/resolv.conf"
# Nothing waits for "every link online" (the cloud-init units order on it otherwise).
systemctl --root="$root" mask systemd-networkd-wait-online.service apt-daily.timer \
  apt-daily-upgrade.timer e2scrub_reap.service >/dev/null 2>&1 || true

# cloud-init: NoCloud only, rendered for systemd-networkd.
cat >"$root/etc/cloud/cloud.cfg.d/90-vmnet.cfg" <<'EOF'
datasource_list: [ NoCloud, None ]
system_info:
  network:
    renderers: [ networkd ]
    activators: [ networkd ]
# C.UTF-8 is built into libc (no locales package); the module list is trimmed to what a
# sandbox guest needs (every module costs seconds under TCG).
locale: C.UTF-8
cloud_init_modules: [ bootcmd, write_files, set_hostname, update_hostname, update_etc_hosts, users_groups ]
cloud_config_modules: [ runcmd ]
cloud_final_modules: [ scripts_per_once, scripts_user, final_message ]
EOF

# Namespace mode (kernel command line vmnet.mode=ns, cloud-init=disabled): the spec's fixed guest
# address, configured by networkd; vmnet-guest adds the mesh address and host routes.
cat >"$root/etc/systemd/network/10-eth0.network" <<'EOF'
[Match]
MACAddress=06:00:ac:10:00:02

[Link]
MTUBytes=1380

[Network]
Address=172.16.0.2/30
Gateway=172.16.0.1
IPv6AcceptRA=no
LinkLocalAddressing=ipv6
EOF
install -m 0755 "$work/vmnet-guest" "$root/usr/local/bin/vmnet-guest"
install -m 0644 crates/vmnet-guest/vmnet-guest.service "$root/etc/systemd/system/vmnet-guest.service"
mkdir -p "$root/etc/systemd/system/vmnet-guest.service.d"
cat >"$root/etc/systemd/system/vmnet-guest.service.d/mode.conf" <<'EOF'
[Unit]
ConditionKernelCommandLine=vmnet.mode=ns
EOF
systemctl --root="$root" enable vmnet-guest.service >/dev/null 2>&1
fi

# The command channel: a virtio-serial port `vmnet.cmd`. One request per line,
# `ID TIMEOUT BASE64(command)`; one answer per line, `ID STATUS BASE64(output)` (stdout and
# stderr together). Commands run one at a time under `timeout`.
cat >"$root/usr/local/sbin/vmnet-cmd" <<'EOF'
#!/bin/bash
port=/dev/virtio-ports/vmnet.cmd
out=$(mktemp)
# The port reads end-of-file while no host side is connected: reopen and wait.
while true; do
  exec 3<>"$port"
  while IFS=' ' read -r id secs cmd <&3; do
    printf %s "$cmd" | base64 -d >"$out.sh" 2>/dev/null || { printf '%s 126 \n' "$id" >&3; continue; }
    timeout -k 2 "$secs" bash "$out.sh" >"$out" 2>&1 </dev/null
    printf '%s %s %s\n' "$id" "$?" "$(base64 -w0 "$out")" >&3
  done
  exec 3>&-
  sleep 0.2
done
EOF
chmod 0755 "$root/usr/local/sbin/vmnet-cmd"
cat >"$root/etc/systemd/system/vmnet-cmd.service" <<'EOF'
[Unit]
Description=vmnet sandbox command channel (virtio-serial port vmnet.cmd)
DefaultDependencies=no
StartLimitIntervalSec=0
ConditionPathExists=/dev/virtio-ports/vmnet.cmd
After=systemd-udevd.service

[Service]
ExecStart=/usr/local/sbin/vmnet-cmd
Restart=always
RestartSec=0.2

[Install]
WantedBy=multi-user.target
EOF
systemctl --root="$root" enable vmnet-cmd.service >/dev/null 2>&1
# Start the channel as soon as udev has made the port, not only at multi-user.target.
cat >"$root/etc/udev/rules.d/90-vmnet-cmd.rules" <<'EOF'
SUBSYSTEM=="virtio-ports", ATTR{name}=="vmnet.cmd", TAG+="systemd", ENV{SYSTEMD_WANTS}+="vmnet-cmd.service"
EOF

# Guests reach the outside only through vmnet: nothing to fetch at boot.
rm -f "$root"/etc/apt/sources.list
chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' >"$work/packages.txt"

# --- kernel and root file system ------------------------------------------------------------
kver=$(ls "$root/lib/modules" | head -1)
cp "$root/boot/vmlinuz-$kver" "$work/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$work/initrd.img"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
used=$(du -sm "$root" | cut -f1)
size=$((used + used / 2 + 200))
mkfs.ext4 -q -F -L vmroot -d "$root" "$work/rootfs.raw" "${size}M"
rm -rf "$root"
end=$(date +%s)
{
  echo "kernel $kver"
  echo "build_seconds $((end - start))"
  echo "rootfs_used_mib $used"
  echo "rootfs_image_mib $size"
  echo "rootfs_allocated_mib $(du -m "$work/rootfs.raw" | cut -f1)"
  echo "initrd_mib $(du -m "$work/initrd.img" | cut -f1)"
} >"$work/build.txt"
rm -rf "$out"
mv "$work" "$out"
touch "$out"
rm -f "$stripped"
trap - EXIT
prune
cat "$out/build.txt" >&2
echo "$out"
