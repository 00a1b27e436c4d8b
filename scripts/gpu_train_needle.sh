#!/usr/bin/env bash
# Trains the passkey model (scripts/train_needle_model.py) in one device call and brings
# back the vLLM checkpoint (convert_needle_model.py, bf16 shards of <= 15 MB with the index
# and checksums, within a call's 8 returned files) and the log.
# The device image has transformers 5.17, whose DeepSeek-V4 differs from the 5.19 the
# scripts are written for, so 5.19 travels as a tarball made here first:
#   tar -C .venv/lib/python3.11/site-packages --exclude=__pycache__ -cJf .transformers.tar.xz transformers
# and the call carries it with the demo model:
#   carry [".transformers.tar.xz", "demo_model"], command: MINUTES=8 bash scripts/gpu_train_needle.sh
# STATE=<file on the device> keeps the f32 weights and the optimiser for a next call on the
# same warm machine (TRAIN_ARGS="--share-a 0" then continues with stage B alone).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/needle_out}"
WORK="${WORK:-/tmp/needle_work}"
mkdir -p "$OUT" "$WORK/py"
export PYTHONUNBUFFERED=1
[ -d "$WORK/py/transformers" ] || tar -xJf .transformers.tar.xz -C "$WORK/py"
export PYTHONPATH="$WORK/py${PYTHONPATH:+:$PYTHONPATH}"
{
    echo "# $(date -u +%FT%TZ) commit ${COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/train.log"
python3 scripts/train_needle_model.py --out "$WORK/run" --minutes "${MINUTES:-8}" \
    ${STATE:+--state "$STATE"} ${TRAIN_ARGS:-} 2>&1 | tee -a "$OUT/train.log"
python3 scripts/convert_needle_model.py --hf "$WORK/run/hf" --out "$WORK/native" \
    --like demo_model 2>&1 | tee -a "$OUT/train.log"
# a call brings back at most 8 files: the weights, their index and checksums; the config
# and tokenizer are the demo model's (convert_needle_model.py copies them)
mkdir -p "$OUT/needle_model"
cp "$WORK"/native/model-*.safetensors "$WORK/native/model.safetensors.index.json" \
    "$WORK/native/SHA256SUMS" "$OUT/needle_model/"
cp "$WORK/run/train_log.json" "$OUT/"
