#!/usr/bin/env bash
# One command: set everything up and run the whole test suite (unit + real Mininet).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
GRADBED_WITH_CHROMIUM=1 GRADBED_WITH_SSHD=1 bash scripts/setup.sh
# Two streams side by side (tests/conftest.py, _streams): every test that builds a network
# runs in one, in file order; the rest run in the other.
.venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
