#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, after `make gpu-bundle` here built
# build/gpu (CUDA libraries, the TVM runtime, the tvm-ffi wheel). That machine has torch
# and CUDA but no TVM: tvm-ffi is installed from the carried wheel into a scratch folder
# and libtvm_runtime is loaded from build/gpu/runtime. Results go to $OUT (default .).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-build/gpu}
OUT=${OUT:-.}
PY=${PY:-python3}
SITE=$(mktemp -d)
$PY -m pip install --quiet --no-index --no-deps --target "$SITE" "$BUNDLE"/wheels/apache_tvm_ffi-*.whl
# libtvm_runtime_cuda.so needs libcudart.so.13: the toolkit's, or the one torch's wheels carry.
CUDART_DIRS=$($PY - <<'PY'
import glob, os, site, sys
dirs = ["/usr/local/cuda/lib64", "/usr/local/cuda/lib"]
for s in site.getsitepackages():
    dirs += glob.glob(os.path.join(s, "nvidia", "*", "lib")) + glob.glob(os.path.join(s, "nvidia", "cu*", "lib"))
print(":".join(d for d in dirs if glob.glob(os.path.join(d, "libcudart.so*"))))
PY
)
export LD_LIBRARY_PATH="$CUDART_DIRS:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}"
export SWA_TVM_RUNTIME_DIR="$BUNDLE/runtime"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -m swa_tvm.gpu_check --libs "$BUNDLE/lib" --batch "$BUNDLE/tune_batch" --out "$OUT" "$@"
