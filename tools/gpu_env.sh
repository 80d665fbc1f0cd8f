# Source on the GPU machine, from the repository root (`. tools/gpu_env.sh`): the
# environment in which swa_tvm runs there on the TVM runtime alone (that machine has
# torch and CUDA but no TVM). tvm-ffi is installed from the bundle's wheel into a scratch
# folder, libtvm_runtime is loaded from $BUNDLE/runtime (default build/gpu, built here by
# `make gpu-bundle`). Used by tools/gpu_check.sh and tools/gpu_decide.sh, and before a
# profiler run, e.g.
#   . tools/gpu_env.sh; ncu_reduced default regex:tc_w4_c64_kernel \
#       $PY -m tools.gpu_profile --function tc_w4_c64
BUNDLE=${BUNDLE:-build/gpu}
PY=${PY:-python3}
OUT=${OUT:-.}
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

# ncu's reduced sections (not --set full: a minute and more per kernel): how near the
# kernel runs to the SM's and memory's peaks, its occupancy, where its warps stall, its
# memory traffic, the schedulers' issue rate, its launch.
NCU_SECTIONS=${NCU_SECTIONS:-"SpeedOfLight ComputeWorkloadAnalysis Occupancy WarpStateStats MemoryWorkloadAnalysis SchedulerStats LaunchStats"}
NCU_TIMEOUT=${NCU_TIMEOUT:-90}

# ncu_reduced NAME KERNEL COMMAND...: the first launch of KERNEL (ncu's -k, e.g.
# regex:tc_w4_c64_kernel) in COMMAND, profiled with NCU_SECTIONS under a timeout of
# NCU_TIMEOUT seconds, into $OUT/ncu_NAME.ncu-rep and its details page
# $OUT/ncu_NAME.txt. Its status: ncu's, 124 when the timeout ended it.
ncu_reduced() {
    local name=$1 kernel=$2 s rc
    shift 2
    if ! command -v ncu > /dev/null; then
        echo "ncu $name: no ncu on this machine"
        return 127
    fi
    local sections=()
    for s in $NCU_SECTIONS; do sections+=(--section "$s"); done
    echo "ncu $name: $kernel (timeout ${NCU_TIMEOUT} s)"
    timeout -k 10 "$NCU_TIMEOUT" ncu --clock-control none "${sections[@]}" -k "$kernel" -c 1 -f \
        -o "$OUT/ncu_$name" "$@"
    rc=$?
    if [ -f "$OUT/ncu_$name.ncu-rep" ]; then
        ncu -i "$OUT/ncu_$name.ncu-rep" --page details > "$OUT/ncu_$name.txt" 2>&1 || { [ "$rc" -ne 0 ] || rc=1; }
    fi
    return $rc
}
