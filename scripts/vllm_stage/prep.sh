#!/usr/bin/env bash
# Stages vLLM 0.33.0, and what its offline engine and `vllm serve` import for DeepSeek-V4 on
# SM90, for a CUDA machine with torch 2.11 / Python 3.12 and no network (our H200 lease).
# Runs here, where PyPI is reachable (~15 min of one core, once per checkout):
#
#   bash scripts/vllm_stage/prep.sh [CARRY_DIR] [WORK_DIR]   (default .vstage_parts, /tmp/vg33)
#
# Output: CARRY_DIR/c1, c2, ... (ignored by git), each at most PART_MIB MiB: by default what
# a device call carries beside the tracked tree (64 MiB in all, less 4 MiB of slack), so
# that one part travels per call.  On the GPU machine, from the repo root, one call per part,
# back to back (everything lives in /tmp/vstage, which a released machine loses):
#
#   source scripts/vllm_stage/stage.sh .vstage_parts/c1     # ... then c2, c3: "vstage: READY"
#   python3 scripts/gpu_engine.py --out $OUT                # vLLM's engine on our model
#
# A JIT cache brought back from an earlier run (vstage_cache.tar.xz, see stage.sh) goes out
# again in any part folder and saves the ~1 minute of kernel compilation.
set -euo pipefail
CARRY="${1:-.vstage_parts}"; WORK="${2:-/tmp/vg33}"
HERE="$(cd "$(dirname "$0")" && pwd)"
PF=""; for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
  manylinux_2_35_x86_64; do PF="$PF --platform $p"; done
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PF"
mkdir -p "$WORK/dl"
# 1. wheels -------------------------------------------------------------------------------
ls "$WORK"/dl/vllm-0.33.0-*.whl >/dev/null 2>&1 || $DL -d "$WORK/dl" vllm==0.33.0
# What DeepseekV4ForCausalLM on CUDA imports that the GPU machine lacks, for the offline engine
# (found by importing the engine/worker/model modules with a faked SM90 platform) and for
# `vllm serve` (found by starting it there):
# - typing-inspection: pydantic's, missing from the machine's python3;
# - compressed-tensors, loguru: the model loader's, imported at run time;
# - nvidia-cutlass-dsl*, quack-kernels: DeepSeek-V4's compressor (head_dim 512) always runs a
#   CuTe-DSL kernel on CUDA;
# - uvicorn, watchfiles, orjson, model-hosting-container-standards with its jmespath and
#   supervisor: the API server's imports; prometheus-fastapi-instrumentator, python-multipart
#   and websockets: its optional ones, staged so that no route is missing.
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-extensions==4.16.0
 cachetools==8.0.2 cbor2==6.3.0 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1
 partial-json-parser==0.2.1.1.post7 fastapi==0.136.3 starlette==1.10.0 sniffio==1.3.1
 openai==2.54.0 jiter==0.19.0 distro==1.9.0 xgrammar==0.2.8 llguidance==1.7.6 oss-harmony==0.0.11
 apache-tvm-ffi==0.1.11 tilelang==0.1.12 z3-solver==4.15.4.0 blake3==1.0.11 setproctitle==1.3.8
 typing-inspection==0.4.5 compressed-tensors==0.17.0 loguru==0.7.3
 nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0
 nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5
 uvicorn==0.38.0 watchfiles==1.3.0 orjson==3.13.0 model-hosting-container-standards==0.1.16
 jmespath==1.1.0 supervisor==4.3.0 prometheus-fastapi-instrumentator==7.1.0
 python-multipart==0.0.34 websockets==17.4"
rm -rf "$WORK/whl"; mkdir -p "$WORK/whl"
$DL -d "$WORK/whl" $WHEELS 2> >(grep -v "Location" >&2)
for spec in $WHEELS; do  # one wheel per pin: a name pip could not find stops here
  n=$(echo "${spec%%==*}" | tr '-' '_'); v="${spec##*==}"
  ls "$WORK"/whl/ | grep -qi "^${n}-${v}-" || { echo "prep.sh: no wheel for $spec" >&2; exit 1; }
done
# 2. one site dir: unzip every wheel into it (= pip install --no-deps --target, no scripts)
S="$WORK/stage/site"; rm -rf "$WORK/stage" "$WORK/bin"; mkdir -p "$S" "$WORK/bin"
for w in "$WORK"/whl/*.whl; do unzip -q -o "$w" -d "$S"; done
unzip -q -o "$WORK"/dl/vllm-0.33.0-*.whl -d "$S" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
  'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/fmha_sm100/*' \
  'vllm/_flashkda_C.abi3.so'
# stub so that `import vllm.vllm_flash_attn` works without the torch-2.14-ABI FA2/FA3 .so
cp "$HERE/_vllm_fa2_C.py" "$S/vllm/vllm_flash_attn/_vllm_fa2_C.py"
# trims: ROCm headers, TVM C++ sources, RECORD files, duplicate libz3
rm -rf "$S/tilelang/3rdparty/composable_kernel" "$S/tilelang/3rdparty/tvm/src" "$S"/*.dist-info/RECORD "$S/bin" "$S"/*.data
rm -f "$S/z3/lib/libz3.so"; ln -s libz3.so.4.15 "$S/z3/lib/libz3.so"
find "$S" -name __pycache__ -prune -exec rm -rf {} +
# 3. big binaries out of the tree; vLLM's two op libraries keep only sm_90 cubins (+ all PTX)
CUTE=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs
mkdir -p "$WORK/bin/c/site/vllm" "$WORK/bin/moe/site/vllm" "$WORK/bin/tl/site/tilelang/lib" "$WORK/bin/tl/site/z3/lib" \
  "$WORK/bin/cute/site/$CUTE" "$WORK/bin/cute/site/nvidia_cutlass_dsl/cu13/lib"
mv "$S/$CUTE"/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so "$WORK/bin/cute/site/$CUTE/"
mv "$S/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so" "$WORK/bin/cute/site/nvidia_cutlass_dsl/cu13/lib/"
python3 "$HERE/fatbin_prune.py" prune "$S/vllm/_C_stable_libtorch.abi3.so" "$WORK/bin/c/site/vllm/_C_stable_libtorch.abi3.so" 90
python3 "$HERE/fatbin_prune.py" prune "$S/vllm/_moe_C_stable_libtorch.abi3.so" "$WORK/bin/moe/site/vllm/_moe_C_stable_libtorch.abi3.so" 90
rm "$S/vllm/_C_stable_libtorch.abi3.so" "$S/vllm/_moe_C_stable_libtorch.abi3.so"
for f in libtvm_compiler.so libtilelang.so libtvm_runtime.so; do mv "$S/tilelang/lib/$f" "$WORK/bin/tl/site/tilelang/lib/"; done
mv "$S/z3/lib/libz3.so.4.15" "$WORK/bin/tl/site/z3/lib/"
# 4. archives (py.tar: headers of DeepGEMM and TileLang's CUTLASS next to each other, so
#    xz -9's 64 MiB window stores the duplicates once)
A="$WORK/arch"; rm -rf "$A"; mkdir -p "$A"
for b in c moe tl cute; do ( cd "$WORK/bin/$b" && tar -cf - site | xz -6 -T1 > "$A/bin_$b.tar.xz" ); done
( cd "$WORK/stage" && find site -path site/tilelang/3rdparty/cutlass -prune -o \
    -path site/vllm/third_party/deep_gemm/include -prune -o \( -type f -o -type l \) -print > "$WORK/py.list"
  tar --no-recursion -cf "$WORK/py.tar" -T "$WORK/py.list"
  tar -rf "$WORK/py.tar" site/tilelang/3rdparty/cutlass site/vllm/third_party/deep_gemm/include
  xz -9 -T1 -c "$WORK/py.tar" > "$A/py.tar.xz"; rm -f "$WORK/py.tar" )
# 5. split into part folders that travel one per call beside the tracked tree
if [ -z "${PART_MIB:-}" ]; then
  TREE=$(cd "$HERE/../.." && git ls-files -z | python3 -c "import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split(chr(0)) if os.path.isfile(p)))")
  PART_MIB=$(( (64 << 20) - TREE - (4 << 20) )); PART_MIB=$(( PART_MIB >> 20 ))
  [ "$PART_MIB" -ge 2 ] || { echo "prep.sh: the tracked tree leaves no room for a part" >&2; exit 1; }
fi
echo "parts of at most $PART_MIB MiB"
PART_MIB="$PART_MIB" python3 "$HERE/pack.py" "$A" "$CARRY"
echo "done: $(du -sh "$CARRY" | cut -f1) in $CARRY"
