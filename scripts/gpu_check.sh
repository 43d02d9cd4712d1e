#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run (CI has none; docs/gpu.md has the last figures).
#   bash scripts/gpu_check.sh        with the project's dependencies importable by $PYTHON
# Prints the board, whether TensorRT is importable, runs the GPU tests (NVML, the TensorRT
# backend's engine tests where TensorRT is installed, tune on a GPU node) and
# bench/gpu_metrics.py (the node's NVML figures beside nvidia-smi, idle and under load).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The project's own imports first: without them every step below fails with a traceback.
if ! "$PYTHON" -c "import msgspec, numpy, onnx, pytest" 2>/dev/null; then
    echo "gpu_check: $PYTHON lacks the project's dependencies (msgspec, numpy, onnx, pytest):" \
        "install them (pip install -e '.[test]'), or carry wheels and put them on PYTHONPATH (docs/gpu.md)" >&2
    exit 2
fi
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || rc=1
"$PYTHON" - <<'PY'
import importlib.util
for name in ("tensorrt", "tensorrt_lean", "pynvml"):
    print(f"{name}: {'importable' if importlib.util.find_spec(name) else 'not installed'}")
PY
ldconfig -p | grep -q libnvinfer && echo "libnvinfer: present" || echo "libnvinfer: absent"
"$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    tests/cloud/test_gpu.py tests/shared/runtimes/test_tensorrt_backend.py \
    tests/cloud/tuning/test_tune.py -k "gpu or tensorrt or GPU" || rc=1
# tune on this node: the GPU in `machine`, and TensorRT listed with why it was (not) tried
tmp=$(mktemp -d)
"$PYTHON" -c "from pathlib import Path; from tests.support import write_linear_model; \
write_linear_model(Path('$tmp/repo/linear/1/model.onnx'))" &&
"$PYTHON" -m cloud.cli tune --repository "$tmp/repo" --max-threads 2 --max-batch 4 \
    --duration-s 0.3 --no-progress --out "$tmp/profiles.json" >/dev/null &&
"$PYTHON" -c "import json; d = json.load(open('$tmp/profiles.json')); \
m = d['models']['linear']; print('tune: machine gpu', d['machine']['gpu'], '| tensorrt', \
m.get('skipped', {}).get('tensorrt'), '| chosen', m.get('chosen', {}).get('backend'))" || rc=1
rm -rf "$tmp"
"$PYTHON" bench/gpu_metrics.py || rc=1
exit $rc
