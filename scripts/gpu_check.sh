#!/usr/bin/env bash
# The DeepSeek-V4 routed decode on a CUDA machine, held to vLLM's FlashMLA:
#   bash scripts/fetch_flashmla.sh            # once, where pip reaches PyPI
#   bash scripts/gpu_check.sh [OUT_JSON [--commit HASH]]   (a copy without git history: name the commit)
# Exits 1 on any mismatch (benchmarks/gpu_fmla_routed.py says what it checks).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$REPO/benchmarks/results/gpu_fmla_routed_$(date +%F)_$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo nogit).json}"
[ -f "$REPO/.fmla/vllm/_flashmla_C.abi3.so" ] || { echo "run scripts/fetch_flashmla.sh first" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
shift || true
PYTHONUNBUFFERED=1 python3 "$REPO/benchmarks/gpu_fmla_routed.py" --fmla-dir "$REPO/.fmla" --out "$OUT" "$@"
