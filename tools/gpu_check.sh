#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, after `make gpu-bundle` here built
# build/gpu (CUDA libraries, the TVM runtime, the tvm-ffi wheel); tools/gpu_env.sh
# sets up the runtime-only environment. Results go to $OUT (default .).
# PROFILE="tc_w4_c64 ..." (variant suffixes of the bundle's variants.json) then profiles
# each of those forwards with ncu, if the machine has it, into $OUT/ncu_details_<v>.txt
# (the profile's own time counts: about a minute each).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
. tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -m tools.gpu_check --libs "$BUNDLE/lib" --batch "$BUNDLE/tune_batch" --out "$OUT" "$@"
for v in ${PROFILE:-}; do
    if ! command -v ncu > /dev/null; then
        echo "PROFILE: no ncu on this machine"
        break
    fi
    ncu --clock-control none --set full -k "regex:${v}_kernel" -c 1 -o "$OUT/prof_$v" \
        $PY -m tools.gpu_profile --libs "$BUNDLE/lib" --function "$v" || true
    ncu -i "$OUT/prof_$v.ncu-rep" --page details > "$OUT/ncu_details_$v.txt" || true
    ncu -i "$OUT/prof_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass_$v.csv" || true
done
