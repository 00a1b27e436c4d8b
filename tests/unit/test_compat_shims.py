"""compat/__init__.py's table of shims, row by row: every module of compat/ is a row or a
helper, every target a row names exists in this vLLM and is named by the module's own
code, and the module's docstring says which upstream file it works around."""
import importlib
import inspect
import pathlib
import re

import pytest

from vllm_dhisparse import compat
from vllm_dhisparse.compat.targets import expect

COMPAT = pathlib.Path(compat.__file__).parent


def test_every_module_of_compat_is_a_row_or_a_helper():
    modules = {p.stem for p in COMPAT.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in COMPAT.iterdir() if (p / "__init__.py").exists()}
    rows = [s.module for s in compat.SHIMS]
    assert len(rows) == len(set(rows))
    assert modules == set(rows) | set(compat.HELPERS)


@pytest.mark.parametrize("shim", compat.SHIMS, ids=[s.module for s in compat.SHIMS])
def test_a_row_names_what_its_module_reaches(shim):
    module = importlib.import_module(f"vllm_dhisparse.compat.{shim.module}")
    source = inspect.getsource(module)
    assert re.search(r"\w/[\w/]+\.py", module.__doc__ or ""), \
        f"{shim.module}: the docstring names no upstream file"
    assert shim.targets and shim.problem and shim.platforms
    for target in shim.targets:
        expect(target)  # exists in this vLLM (IntegrationError names it otherwise)
        leaf = target.replace(":", ".").rsplit(".", 1)[-1]
        assert leaf in source, f"{shim.module} does not reach {target}"
