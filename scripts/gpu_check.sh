#!/usr/bin/env bash
# The core on CUDA, in one device call (the device machine has torch + Triton, no vLLM):
#   1. every test of the core (kernels, hierarchy, host store, resolver) on the GPU,
#      the asynchronous CUDA property machine included;
#   2. with BEFORE=<tree>: the same property machine against an older tree of the
#      package; with SHIM=<dir>: the CUDA backup tests with the pytest plugin
#      ``old_backup`` from <dir> loaded (a replaced backup path, expected to fail);
#   3. benchmarks/gpu_correctness.py: all 18 configurations in one results file;
#   4. with vLLM 0.33's FlashMLA in .fmla (bash scripts/fetch_flashmla.sh, carried to the
#      machine): benchmarks/gpu_fmla_routed.py, the DeepSeek-V4 c4a decode routed through
#      KVHierarchy against FlashMLA on vLLM's blocks (FMLA_PARTS: checks,routing,graph,timing),
#      then benchmarks/gpu_fmla_decode.py (the routed decode's locations from vLLM's decode
#      metadata: ragged queries, rows of the step itself, padding; FMLA_DECODE=0 skips it).
# Steps 1-3 run unless TESTS=0 / CORRECTNESS=0.
# Logs and the results file go to $OUT (the device tool brings them back).
#   bash scripts/gpu_check.sh            (OUT=/tmp/gpu_check by default)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/core_cuda.log"
{
    echo "# $(date -u +%FT%TZ) commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$LOG"

tests_rc=skipped
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs tests/kernels tests/unit \
        --ignore=tests/unit/test_dashboard.py --ignore=tests/unit/test_worker_side.py 2>&1 | tee -a "$LOG"
    tests_rc=${PIPESTATUS[0]}
fi

if [ -n "${BEFORE:-}" ]; then
    # the new property test, run against the older package in $BEFORE
    cp tests/unit/test_hierarchy_properties.py "$BEFORE/tests/unit/"
    (cd "$BEFORE" && timeout 120 python3 -m pytest -q -p no:cacheprovider -x \
        tests/unit/test_hierarchy_properties.py -k AsyncCuda 2>&1) | tail -40 > "$OUT/before_async.log"
    echo "before-tree property test (expected to fail):" | tee -a "$LOG"
    tail -3 "$OUT/before_async.log" | tee -a "$LOG"
fi

if [ -n "${SHIM:-}" ]; then
    PYTHONPATH="$SHIM" timeout 180 python3 -m pytest -q -p no:cacheprovider -p old_backup \
        tests/unit/test_hierarchy_properties.py tests/unit/test_host_store.py \
        -k "AsyncCuda or still_being_produced" 2>&1 | tail -60 > "$OUT/old_backup.log"
    echo "with the old backup path (expected to fail):" | tee -a "$LOG"
    grep -E "^(FAILED|E  )|passed|failed" "$OUT/old_backup.log" | head -20 | tee -a "$LOG"
fi

corr_rc=skipped
if [ "${CORRECTNESS:-1}" = 1 ]; then
    DHISPARSE_COMMIT="${COMMIT:-}" timeout "${CORRECTNESS_TIMEOUT:-330}" python3 benchmarks/gpu_correctness.py \
        --out "$OUT/gpu_correctness.json" 2>&1 | tee "$OUT/gpu_correctness.log" | tail -25
    corr_rc=${PIPESTATUS[0]}
fi
fmla_rc=skipped
if [ -f .fmla/vllm/_flashmla_C.abi3.so ]; then
    timeout "${FMLA_TIMEOUT:-400}" python3 benchmarks/gpu_fmla_routed.py --fmla-dir .fmla \
        --parts "${FMLA_PARTS:-checks,routing,graph,timing}" ${COMMIT:+--commit "$COMMIT"} \
        --out "$OUT/gpu_fmla_routed.json" 2>&1 | tee "$OUT/gpu_fmla_routed.log" | tail -45
    fmla_rc=${PIPESTATUS[0]}
    # the routed decode's locations as the FlashMLA layer computes them (flashmla/decode.py)
    if [ "${FMLA_DECODE:-1}" = 1 ]; then
        timeout "${FMLA_TIMEOUT:-400}" python3 benchmarks/gpu_fmla_decode.py --fmla-dir .fmla \
            ${COMMIT:+--commit "$COMMIT"} --out "$OUT/gpu_fmla_decode.json" 2>&1 \
            | tee "$OUT/gpu_fmla_decode.log" | tail -5
        [ "${PIPESTATUS[0]}" = 0 ] || fmla_rc=1
    fi
fi
echo "tests rc=$tests_rc correctness rc=$corr_rc fmla rc=$fmla_rc"
