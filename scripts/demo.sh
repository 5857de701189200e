#!/usr/bin/env bash
# One command: set everything up and run the demo experiment.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gradbed run configs/demo.toml "$@"
