#!/usr/bin/env bash
# The GPU machine's side of scripts/vllm_stage/prep.sh.  Source it from the repo root once per
# part folder as it arrives, one device call each, back to back:
#
#   source scripts/vllm_stage/stage.sh .vstage_parts/c1     # then c2, c3 ... -> "vstage: READY"
#
# Unpacks into $VSTAGE (default /tmp/vstage, which must survive until the last part arrives;
# a released machine loses it: start again from part 1), checks SHA-256s against MANIFEST,
# joins split archives once all their pieces have arrived, and exports the environment the
# engine needs.  Idempotent (an archive already unpacked, by name, is skipped: a machine staged
# from other parts wants a fresh VSTAGE); sourcing it again with any folder (an empty one too) in a later
# call on the same machine only re-exports the environment.  A folder that holds
# vstage_cache.tar.xz (a JIT cache brought back from an earlier run:
# `tar -C $VSTAGE -cJf $OUT/vstage_cache.tar.xz cache`) restores it, which saves the kernel
# compilation of a first start.
_vs_src="${1:?part folder, e.g. .vstage_parts/c1}"
export VSTAGE="${VSTAGE:-/tmp/vstage}"
mkdir -p "$VSTAGE/parts" "$VSTAGE/done" "$VSTAGE/cache"
_vs_t0=$(date +%s.%N)
if [ -f "$_vs_src/vstage_cache.tar.xz" ] && [ ! -e "$VSTAGE/done/vstage_cache" ]; then
  tar -C "$VSTAGE" -xJf "$_vs_src/vstage_cache.tar.xz" && touch "$VSTAGE/done/vstage_cache"
fi
_vs_manifest="$_vs_src/MANIFEST"
[ -f "$_vs_manifest" ] || _vs_manifest="$(ls "$VSTAGE"/MANIFEST 2>/dev/null || echo /dev/null)"
[ "$_vs_manifest" = /dev/null ] || cp -n "$_vs_manifest" "$VSTAGE/MANIFEST" 2>/dev/null || true
for _f in "$_vs_src"/*.tar.xz "$_vs_src"/*.tar "$_vs_src"/*.part[0-9]*; do
  case "$(basename "$_f")" in vstage_cache.tar.xz) continue ;; esac
  [ -e "$_f" ] || continue
  _b=$(basename "$_f")
  [ -e "$VSTAGE/done/$_b" ] && continue
  _want=$(awk -v n="$_b" '$1==n{print $3}' "$_vs_manifest")
  _got=$(sha256sum "$_f" | cut -d' ' -f1)
  if [ "$_want" != "$_got" ]; then echo "vstage: SHA-256 MISMATCH $_b"; continue; fi
  case "$_b" in
    *.part[0-9]*) cp "$_f" "$VSTAGE/parts/$_b" ;;
    *.tar.xz) tar -C "$VSTAGE" -xJf "$_f" ;;
    *.tar) tar -C "$VSTAGE" -xf "$_f" ;;
  esac && touch "$VSTAGE/done/$_b"
done
for _base in $(awk '{print $1}' "$_vs_manifest" | grep '\.part[0-9]*$' | sed 's/\.part[0-9]*$//' | sort -u); do
  [ -e "$VSTAGE/done/$_base" ] && continue
  _need=$(awk '{print $1}' "$_vs_manifest" | grep -c "^$_base\.part")
  _have=$(ls "$VSTAGE/parts/" | grep -c "^$_base\.part")
  [ "$_need" = "$_have" ] || continue
  case "$_base" in
    *.tar.xz) cat "$VSTAGE/parts/$_base".part* | tar -C "$VSTAGE" -xJf - ;;
    *) cat "$VSTAGE/parts/$_base".part* | tar -C "$VSTAGE" -xf - ;;
  esac && touch "$VSTAGE/done/$_base" && rm -f "$VSTAGE/parts/$_base".part*
done
_vs_missing=""
for _b in $(awk '{print $1}' "$_vs_manifest" | sed 's/\.part[0-9]*$//' | sort -u); do
  [ -e "$VSTAGE/done/$_b" ] || _vs_missing="$_vs_missing $_b"
done
echo "vstage: unpacked $_vs_src in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $_vs_t0}") s; $(du -sh "$VSTAGE" | cut -f1) staged"
if [ "$_vs_manifest" = /dev/null ]; then echo "vstage: no MANIFEST yet (no part folder has arrived)"
elif [ -z "$_vs_missing" ]; then echo "vstage: READY"
else echo "vstage: still missing:$_vs_missing"; fi
unset _vs_src _vs_t0 _vs_manifest _vs_missing _f _b _base _want _got _need _have

# --- environment -------------------------------------------------------------------------
# (PYTHONPATH does not run .pth files: add the CuTe DSL's package root by hand)
export PYTHONPATH="$VSTAGE/site:$VSTAGE/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; else CUDA_HOME=/usr/local/cuda; fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CACHE_ROOT="$VSTAGE/cache/vllm" TVM_FFI_CACHE_DIR="$VSTAGE/cache/tvm-ffi"
export TILELANG_CACHE_DIR="$VSTAGE/cache/tilelang" DG_JIT_CACHE_DIR="$VSTAGE/cache/deep_gemm"
export TRITON_CACHE_DIR="$VSTAGE/cache/triton"
# tvm_ffi (used by xgrammar and TileLang) would otherwise JIT-build a torch DLPack addon
# with g++ on first import when torch lacks __dlpack_c_exchange_api__; it is only a
# speed-up of tensor hand-over, so skip it.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
# vLLM's V2 model runner asks flashinfer_sampler_supported(), which imports FlashInfer
# (not staged) unless this is 0; greedy/top-k/top-p then use vLLM's own sampler.
export VLLM_USE_FLASHINFER_SAMPLER=0
