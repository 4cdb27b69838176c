#!/usr/bin/env bash
# Runs every vmnet test on a fresh Debian 12 machine, as root: installs packages, checks format and
# lints, builds the book, then the whole workspace suite (unit, PostgreSQL and SQLite conformance, API, and kernel
# tests that build throwaway network namespaces and send real packets).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "scripts/test.sh must run as root: the kernel tests create network namespaces" >&2
  exit 1
fi

# Two tools, pinned and built once into ~/.cargo/bin: cargo-machete (unused dependencies fail
# the run) and mdBook (the book in docs/, without its server and file watcher). They build
# while apt installs the Debian packages, in a profile that compiles fast (they only run here).
machete_version=0.9.2
mdbook_version=0.5.4
tools() {
  export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=false
  if [ "$(cargo machete --version 2>/dev/null)" != "$machete_version" ]; then
    cargo install cargo-machete --version "$machete_version" --locked --quiet
  fi
  if [ "$(mdbook --version 2>/dev/null)" != "mdbook v$mdbook_version" ]; then
    cargo install mdbook --version "$mdbook_version" --locked --quiet \
      --no-default-features --features search
  fi
}
tools &
tools_pid=$!
scripts/install-deps.sh
wait "$tools_pid"

cargo fmt --all -- --check
cargo machete
# A build error of the book fails the run. Its links and examples are checked by the vmnet
# tests `docs` and `kernel_docs_examples`.
mdbook build docs
cargo clippy --workspace --all-targets --locked -- -D warnings
# Tests that need root (they build network namespaces) are marked #[ignore = "needs root: …"], so
# a plain `cargo test` as a normal user runs the rest and counts these as ignored. Here, as root,
# every one of them runs; a run that still ignored any test fails.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# The kernel tests run the workspace's binaries (vmnet; vmnet-lab, which runs the agent from the
# vmnet beside it; vmnet-guest inside a simulated guest): `cargo test` builds only the binaries of
# packages with integration tests, so build them all first.
cargo build --workspace --bins --locked
# The real-guest tests (one per mode) boot qemu guests (building the guest image on first use,
# cached in /var/cache/vmnet-guest), and the package test boots a Debian VM from the host image
# (`scripts/guest-image.sh --host`) to install the vmnet package in: without /dev/kvm they are
# skipped and counted so, which fails the run.
skip=() kvm_skipped=0
if [ ! -e /dev/kvm ]; then
  echo "no /dev/kvm: the real-guest tests (kvm_guests_in_the_pool_sandbox, kvm_guests_in_the_namespace_sandbox, kvm_package_on_a_fresh_debian_vm) are skipped" >&2
  skip=(--skip kvm_guests_in_the_pool_sandbox --skip kvm_guests_in_the_namespace_sandbox
    --skip kvm_package_on_a_fresh_debian_vm) kvm_skipped=3
fi
# The two images (network-bound: mmdebstrap fetches Debian packages) build one after the other
# while the tests compile; a failure here is left to the KVM tests, which build them again and
# report why.
image_pid=
if [ -e /dev/kvm ]; then
  {
    scripts/guest-image.sh "${CARGO_TARGET_DIR:-target}/debug/vmnet-guest" >/dev/null || true
    scripts/guest-image.sh --host >/dev/null
  } &
  image_pid=$!
fi
cargo test --workspace --all-targets --locked --no-run
if [ -n "$image_pid" ]; then wait "$image_pid" || echo "guest images: the KVM tests build them again" >&2; fi
cargo test --workspace --all-targets --locked --no-fail-fast -- --include-ignored "${skip[@]}" 2>&1 |
  tee "$log" || status=$?
awk -v extra="$kvm_skipped" '/^test result:/ { p += $4; f += $6; i += $8 }
     END { i += extra; printf "tests: %d passed, %d failed, %d skipped\n", p, f, i; exit (f > 0 || i > 0) }' "$log" ||
  status=1
exit "$status"
