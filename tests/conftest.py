"""The whole suite runs at one ISA level (tests/isa.py): AVX-512 without AMX wherever the
CPU has AVX-512, emulated on a CPU with AMX, so that a test passing only with AMX's
defaults or rounding fails on any machine; ``DHISPARSE_TEST_ISA`` picks another level."""
from tests import isa


def pytest_configure(config):
    isa.emulate_here(isa.session_level())


def pytest_report_header(config):
    level, hw = isa.session_level(), isa.native()
    how = "native" if level == hw else f"emulated on a CPU with {hw}"
    return f"dhisparse ISA level: {level} ({how}); also runs: {isa.available()}"
