#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the quick-start demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
