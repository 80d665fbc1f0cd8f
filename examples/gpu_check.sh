#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, after `make gpu-bundle` here built
# build/gpu (CUDA libraries, the TVM runtime, the tvm-ffi wheel); examples/gpu_env.sh
# sets up the runtime-only environment. Results go to $OUT (default .).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
. examples/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -m swa_tvm.gpu_check --libs "$BUNDLE/lib" --batch "$BUNDLE/tune_batch" --out "$OUT" "$@"
