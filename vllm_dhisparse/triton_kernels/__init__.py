"""Resolver kernels: Triton launchers and their torch references (the spec).

Where Triton is not installed only the references are exported.  Triton's interpreter
(CPU) needs a fix for NumPy 2.4, applied with the interpreter itself
(``vllm_dhisparse/compat/triton_interpreter.py``).
"""
import importlib.util

from .reference import (
    COUNTER_DIRECT,
    COUNTER_FETCHED,
    COUNTER_HOST,
    COUNTER_HOT,
    NUM_COUNTERS,
    gather_reference,
    resolve_reference,
)

__all__ = [
    "COUNTER_DIRECT", "COUNTER_FETCHED", "COUNTER_HOST", "COUNTER_HOT", "NUM_COUNTERS",
    "gather_reference", "resolve_reference",
]


if importlib.util.find_spec("triton") is not None:
    from .gather import gather_rows
    from .resolve import resolve

    __all__ += ["gather_rows", "resolve"]
