# Source on the GPU machine, from the repository root (`. tools/gpu_env.sh`): the
# environment in which swa_tvm runs there on the TVM runtime alone (that machine has
# torch and CUDA but no TVM). tvm-ffi is installed from the bundle's wheel into a scratch
# folder, libtvm_runtime is loaded from $BUNDLE/runtime (default build/gpu, built here by
# `make gpu-bundle`). Used by tools/gpu_check.sh, and before a profiler run, e.g.
#   . tools/gpu_env.sh; ncu --set full -k regex:tc_w4_c64_kernel -c 1 -o prof \
#       python3 -m tools.gpu_profile --function tc_w4_c64
BUNDLE=${BUNDLE:-build/gpu}
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
