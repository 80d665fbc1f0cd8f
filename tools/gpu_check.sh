#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, after `make gpu-bundle` here built
# build/gpu (CUDA libraries, the TVM runtime, the tvm-ffi wheel); tools/gpu_env.sh
# sets up the runtime-only environment. Results go to $OUT (default .). Arguments go to
# tools.gpu_check (e.g. --stages, --tune, --budget-s, --child-timeout-s).
# PROFILE="tc_w4_c64 ..." (variant suffixes of the bundle's variants.json) then profiles
# each of those forwards with ncu's reduced sections, if the machine has ncu, into
# $OUT/ncu_<v>.txt, each under its own timeout (NCU_TIMEOUT, default 90 s), whatever
# the check's outcome. The exit status is the check's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
mkdir -p "$OUT"
. tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -m tools.gpu_check --libs "$BUNDLE/lib" --batch "$BUNDLE/tune_batch" --out "$OUT" "$@"
rc=$?
[ "$rc" -eq 0 ] || echo "gpu_check: exit status $rc (its results are in $OUT/gpu_results.json); profiling goes on"
for v in ${PROFILE:-}; do
    ncu_reduced "$v" "regex:${v}_kernel" $PY -m tools.gpu_profile --libs "$BUNDLE/lib" --function "$v" \
        || echo "ncu $v: exit status $?"
done
exit $rc
