#!/usr/bin/env bash
# One command: set everything up and run the whole test suite (unit + real Mininet).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
GRADBED_WITH_CHROMIUM=1 GRADBED_WITH_SSHD=1 bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
