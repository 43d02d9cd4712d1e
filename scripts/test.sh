#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m ruff check . || exit 1
# Workers: one per core, at most 4 (most tests wait on processes and sockets; more
# workers than that start more servers at once than they save).  An -n of the caller's
# comes after and wins (-n 0: one process).
workers=$(nproc 2>/dev/null || echo 2)
if [ "$workers" -gt 4 ]; then workers=4; fi
if [ "$workers" -lt 2 ]; then workers=2; fi
.venv/bin/python -m pytest -n "$workers" "$@"
rc=$?
# pytest exits 5 when a selection holds no test: not a failure of the suite.
if [ "$rc" -eq 5 ]; then exit 0; fi
exit "$rc"
