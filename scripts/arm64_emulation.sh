#!/usr/bin/env bash
# An emulated arm64 Debian (bookworm, CPython 3.11) to run the device runtime in, on an x86_64 Debian host.
#
#   scripts/arm64_emulation.sh setup                 # once: host packages, binfmt, the root file system
#   scripts/arm64_emulation.sh run [--bind DIR] CMD  # run CMD (a shell command line) inside, as root
#
# setup (as root): apt-installs qemu-user-static, debootstrap and binfmt-support where missing; mounts
# binfmt_misc (it starts unmounted) and enables qemu-aarch64 (flags PF: qemu need not be in the root file
# system); debootstraps arm64 bookworm (minbase, python3, python3-venv, ca-certificates) from the mirror apt
# uses here into $FEDARA_ARM64_ROOT (default .arm64/rootfs, gitignored; ~3 min the first time, reused after);
# copies the host's CA bundle in and points pip at it (outbound TLS may be intercepted).
# run: a private mount namespace (unshare --mount) with /proc, /dev and /sys mounted, DIR (default: none)
# bind-mounted at the same path inside, then chroot. The chroot shares the host's network: a device inside
# reaches a broker on the host's 127.0.0.1. Emulated float work is 50-150x slower than native: keep it tiny.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${FEDARA_ARM64_ROOT:-$here/.arm64/rootfs}"
suite=bookworm
ca_inside=/etc/fedara-host-ca.crt

die() {
  echo "arm64_emulation.sh: $*" >&2
  exit 2
}

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, mounts, chroot)"

mirror() {
  # The first deb.debian.org-style URI apt uses here (deb822 .sources or one-line .list files).
  local uri
  uri="$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
    /etc/apt/sources.list.d/*.list 2>/dev/null | grep -v security | head -n1 \
    | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' | awk '{print $1}')"
  echo "${uri:-http://deb.debian.org/debian}"
}

setup_host() {
  local missing=()
  command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v update-binfmts >/dev/null || missing+=(binfmt-support)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "qemu-aarch64 is not registered with binfmt_misc"
}

setup_root() {
  if [ ! -e "$root/.fedara-ready" ]; then
    rm -rf "$root.partial"
    mkdir -p "$(dirname "$root")"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
      "$suite" "$root.partial" "$(mirror)" >/dev/null
    rm -rf "$root"
    mv "$root.partial" "$root"
    touch "$root/.fedara-ready"
  fi
  cp /etc/ssl/certs/ca-certificates.crt "$root$ca_inside"
  printf '[global]\ncert = %s\ndisable-pip-version-check = true\n' "$ca_inside" >"$root/etc/pip.conf"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}

run_inside() {
  local bind=""
  if [ "${1:-}" = --bind ]; then
    [ $# -ge 2 ] || die "--bind needs a folder"
    bind="$(cd "$2" && pwd)"
    shift 2
  fi
  [ $# -ge 1 ] || die "run needs a command"
  [ -e "$root/.fedara-ready" ] || die "no root file system at $root: run '$0 setup' first"
  mountpoint -q /proc/sys/fs/binfmt_misc && [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] \
    || die "qemu-aarch64 binfmt is not enabled: run '$0 setup' first"
  exec unshare --mount --propagation private -- bash -euc '
    root="$1" bind="$2" command="$3"
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    if [ -n "$bind" ]; then
      mkdir -p "$root$bind"
      mount --bind "$bind" "$root$bind"
    fi
    exec chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
      PIP_CERT='"$ca_inside"' /bin/bash -euc "$command"
  ' _ "$root" "$bind" "$*"
}

case "${1:-}" in
  setup)
    setup_host
    setup_root
    echo "arm64 root file system ready at $root ($(run_inside 'uname -m; python3 --version' | tr '\n' ' '))"
    ;;
  run)
    shift
    run_inside "$@"
    ;;
  *) die "usage: $0 setup | run [--bind DIR] COMMAND" ;;
esac
