#!/usr/bin/env bash
# vLLM 0.33.0's FlashMLA (stable torch ABI, loads on other torch releases) in an ignored
# folder, for scripts/gpu_check.sh (benchmarks/gpu_fmla_routed.py) on a GPU machine without vLLM:
#   bash scripts/fetch_flashmla.sh [DIR]        (default .fmla; ~4 MB of the 336 MB wheel)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$REPO/.fmla}"
WHEEL_DIR="$(mktemp -d)"
trap 'rm -rf "$WHEEL_DIR"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: "vllm==0.33.0" -d "$WHEEL_DIR"
mkdir -p "$DIR"
unzip -q -o "$WHEEL_DIR"/vllm-0.33.0-*.whl 'vllm/_flashmla_C.abi3.so' \
    'vllm/_flashmla_extension_C.abi3.so' 'vllm/third_party/flashmla/*' -d "$DIR"
touch "$DIR/vllm/__init__.py" "$DIR/vllm/third_party/__init__.py"  # a stub package: no vLLM
echo "FlashMLA from vllm==0.33.0 in $DIR"
