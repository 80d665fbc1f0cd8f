#!/usr/bin/env bash
# The decision run for the Hopper forward's design: one command on the GPU machine, from
# the repository root, with build/gpu (`make gpu-bundle`) carried there:
#   bash tools/gpu_decide.sh
# In under DECIDE_S seconds (default 480), everything into $OUT (default .):
# 1. the GPU check's stages variants,bars,training,scaling (tools.gpu_check: the wgmma
#    probes, the wgmma forwards and the other forward variants at the bar shape; ours
#    and each variant against FlexAttention and the matmul rate; training; scaling), no
#    MetaSchedule batch: gpu_results.json;
# 2. FlexAttention's own tiles (tools.flex_ablation: BLOCK_M 64/128 x num_stages 1/3):
#    flex_ablation.json;
# 3. ncu's reduced sections of our fastest agreeing wgmma forward, our default forward
#    (variants.json's) and Flex's kernel: ncu_best.txt, ncu_default.txt, ncu_flex.txt
#    (and their .ncu-rep);
# 4. a summary at the end of log.txt (tools.gpu_summary), which holds everything printed.
# Each step runs under its own timeout, capped by the time left; a step that fails does
# not stop the ones after it. Arguments go to tools.gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
mkdir -p "$OUT"
DECIDE_S=${DECIDE_S:-480}        # the whole run
CHECK_S=${CHECK_S:-260}          # the GPU check's --budget-s (its timeout: 30 s more)
CHILD_TIMEOUT_S=${CHILD_TIMEOUT_S:-30}
ABLATION_S=${ABLATION_S:-80}     # the ablation's --budget-s (its timeout: 20 s more)
END=$((SECONDS + DECIDE_S))
exec > >(tee -a "$OUT/log.txt") 2>&1

# cap N: N, or the seconds left if fewer.
cap() {
    local left=$((END - SECONDS))
    [ "$left" -lt 0 ] && left=0
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

. tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -V
cat "$BUNDLE/COMMIT" 2> /dev/null || true

echo "== gpu_check (budget ${CHECK_S} s)"
timeout -k 10 "$(cap $((CHECK_S + 30)))" $PY -m tools.gpu_check --libs "$BUNDLE/lib" --out "$OUT" \
    --stages variants,bars,training,scaling --budget-s "$CHECK_S" --child-timeout-s "$CHILD_TIMEOUT_S" "$@"
echo "gpu_check: exit status $?"

echo "== flex_ablation (budget ${ABLATION_S} s)"
T=$(cap $((ABLATION_S + 20)))
if [ "$T" -gt 20 ]; then
    timeout -k 10 "$T" $PY -m tools.flex_ablation --out "$OUT" --budget-s "$((T - 20))" --row-timeout-s 60
    echo "flex_ablation: exit status $?"
else
    echo "flex_ablation: skipped, ${T} s left"
fi

echo "== ncu"
DEFAULT=$($PY -m tools.gpu_profile --libs "$BUNDLE/lib" --pick default) || DEFAULT=tc_w4_c64
BEST=$($PY -m tools.gpu_profile --libs "$BUNDLE/lib" --pick best --results "$OUT/gpu_results.json") \
    || BEST=tc_w8_c64_async_wgmma_s2
echo "ncu: best $BEST, default $DEFAULT, flex"
for job in "best:$BEST:60" "default:$DEFAULT:60"; do
    IFS=: read -r name v limit <<< "$job"
    NCU_TIMEOUT=$(cap "$limit")
    if [ "$NCU_TIMEOUT" -lt 15 ]; then echo "ncu $name: skipped, ${NCU_TIMEOUT} s left"; continue; fi
    ncu_reduced "$name" "regex:${v}_kernel" $PY -m tools.gpu_profile --libs "$BUNDLE/lib" --function "$v" \
        || echo "ncu $name: exit status $?"
done
NCU_TIMEOUT=$(cap 120)
if [ "$NCU_TIMEOUT" -ge 30 ]; then
    ncu_reduced flex regex:triton_tem $PY -m tools.gpu_profile --flex || echo "ncu flex: exit status $?"
else
    echo "ncu flex: skipped, ${NCU_TIMEOUT} s left"
fi

echo "== summary ($SECONDS s)"
$PY -m tools.gpu_summary "$OUT" || true
