#!/usr/bin/env bash
# One command: set everything up and run the demo: the same training twice over the same
# bottleneck, dense and top-k with error feedback, printed side by side with a verdict.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gradbed sweep configs/demo.toml --grid compress.name=none,topk "$@"
