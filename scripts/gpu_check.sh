#!/usr/bin/env bash
# `make gpu_check` on a GPU machine: the image's Python (JAX with CUDA) plus the wheels
# scripts/gpu_wheels.sh carried in .gpu_wheels/ (what the image lacks, at our pins), then
# scripts/gpu_check.py. Its output goes to $OUT when set (the device tool hands back only
# that folder), else results/gpu_check/<UTC time>.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".gpu_wheels/*.whl" >/dev/null; then
  site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .gpu_wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # ours first; the image's stay put
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
