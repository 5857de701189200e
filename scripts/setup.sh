#!/usr/bin/env bash
# Idempotent setup for a fresh Debian machine: system packages, .venv, the project.
# Re-executes itself through sudo when not root (Mininet needs root anyway).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
cd "$(dirname "$0")/.."

APT_PKGS=(mininet bridge-utils iperf3 iputils-ping iproute2 ethtool tcpdump tcpreplay psmisc
          iptables             # delay (NFQUEUE) and loss (statistic) without netem
          python3-cryptography # Poly1305 frame MACs (the venv sees system site-packages)
          dataset-fashion-mnist)  # Fashion-MNIST IDX files, read by agents/workloads
# Chromium renders the HTML report in the test suite; only the tests ask for it.
if [ "${GRADBED_WITH_CHROMIUM:-0}" = "1" ]; then APT_PKGS+=(chromium); fi
# sshd for the fake cluster servers of the tests (scripts/fake_cluster.sh), which start
# their own; the system service is neither enabled nor started (below, and policy-rc.d).
if [ "${GRADBED_WITH_SSHD:-0}" = "1" ]; then APT_PKGS+=(openssh-server); fi

missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "== apt-get install ${missing[*]}"
    apt-get update -qq
    # exit 101 from policy-rc.d: no package may start its service while installing.
    no_start=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        no_start=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    if [ "$no_start" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
if [ "${GRADBED_WITH_SSHD:-0}" = "1" ]; then
    # The package enables ssh.service; the tests only ever run their own sshds.
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
        systemctl disable --now ssh.service >/dev/null 2>&1 || true
    else
        rm -f /etc/systemd/system/multi-user.target.wants/ssh.service \
              /etc/systemd/system/sshd.service
    fi
fi

# Mininet lives in Debian's python3, so the venv must see the system site-packages.
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv from /usr/bin/python3"
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.gradbed-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "== pip install -e .[dev] (torch==2.13.0 CPU)"
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[dev]"
    touch "$stamp"
fi
# speedscope (MIT, an offline web viewer of Chrome traces) opens a run's trace.json in
# headless Chromium in the tests; npm from Debian installs it into the venv.
if [ "${GRADBED_WITH_CHROMIUM:-0}" = "1" ] && command -v npm >/dev/null \
        && [ ! -f .venv/share/speedscope/node_modules/speedscope/dist/release/index.html ]; then
    echo "== npm install speedscope@1.25.0 (into .venv/share/speedscope)"
    npm install -q --no-audit --no-fund --prefix .venv/share/speedscope speedscope@1.25.0 \
        >/dev/null
fi
# Leftovers from a crashed earlier run would break the next one.
.venv/bin/gradbed cleanup >/dev/null 2>&1 || true
echo "== setup done"
