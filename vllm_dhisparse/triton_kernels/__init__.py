"""Resolver kernels: Triton launchers and their torch references (the spec).

Where Triton is not installed only the references are exported.
"""
import importlib.util
import os

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


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter runs ``int()`` on 1-element arrays, which NumPy 2.4
    rejects, so any loop bounded by a runtime scalar fails (triton-lang/triton#9171).
    Applies the upstream fix (#9172) when interpreting with an affected Triton."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "int(self.handle.data))" not in inspect.getsource(original):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if importlib.util.find_spec("triton") is not None:
    from .gather import gather_rows
    from .resolve import resolve

    __all__ += ["gather_rows", "resolve"]
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        _fix_interpreter_for_numpy_2_4()
