#!/usr/bin/env bash
# Install the system servers and tools the integration tests start: redis-server, etcd, and
# chromium (the live page opened headless, tests/integration/test_live_page.py) (Debian/Ubuntu).
#
# Idempotent and fast when everything is present: apt is touched only for what is missing,
# and `apt-get update` runs at most once.
#
# The Debian packages' postinst scripts start a system daemon (invoke-rc.d, or systemctl
# through deb-systemd-invoke): redis on 6379, etcd on 2379. The tests never use those — they
# start their own servers on free ports — so while installing we put a policy-rc.d in place
# that answers 101 ("action not allowed"); both invoke-rc.d and deb-systemd-invoke honour it.
# It is removed afterwards. If the machine already has a policy-rc.d (Docker images usually
# do, with `exit 101`), it is left alone and decides as it always does. Nothing already
# running is stopped: this script starts and kills no server.
set -euo pipefail

POLICY=/usr/sbin/policy-rc.d
# binary:package pairs; etcd-server provides /usr/bin/etcd (etcd 3.4 on Debian 12).
DEPS=("redis-server:redis-server" "etcd:etcd-server" "chromium:chromium")

die() {
    echo "install-system-deps: $*" >&2
    exit 1
}

have() {
    command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ]
}

missing_bins=()
missing_pkgs=()
for dep in "${DEPS[@]}"; do
    bin=${dep%%:*}
    pkg=${dep#*:}
    if have "$bin"; then
        echo "$bin: present ($(command -v "$bin" || echo "/usr/bin/$bin"))"
    else
        missing_bins+=("$bin")
        missing_pkgs+=("$pkg")
    fi
done
[ ${#missing_pkgs[@]} -eq 0 ] && exit 0

command -v apt-get >/dev/null 2>&1 \
    || die "apt-get not found; install ${missing_pkgs[*]} with this system's package manager"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "not root and no sudo: run as root to install ${missing_pkgs[*]}"
    SUDO=(sudo)
fi

remove_policy=false
cleanup() {
    if $remove_policy; then
        "${SUDO[@]}" rm -f "$POLICY" || echo "install-system-deps: could not remove $POLICY" >&2
    fi
}
trap cleanup EXIT
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\n# temporary, from pilotfish scripts/install-system-deps.sh\nexit 101\n' \
        | "${SUDO[@]}" tee "$POLICY" >/dev/null
    "${SUDO[@]}" chmod 755 "$POLICY"
    remove_policy=true
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq \
    || die "apt-get update failed (network or sources list?); ${missing_pkgs[*]} not installed"
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" \
    || die "apt-get install ${missing_pkgs[*]} failed; see apt's output above"

for bin in "${missing_bins[@]}"; do
    have "$bin" || die "$bin still not found after installing its package"
    echo "$bin: installed ($(command -v "$bin" || echo "/usr/bin/$bin"))"
done
