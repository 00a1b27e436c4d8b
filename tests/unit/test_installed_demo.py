"""The demo from an installed package: the package alone (copied out of the repository, as
a wheel installs it) builds the random demo model and its drafter, and the demo without
the repository's trained model says what to pass instead."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> pathlib.Path:
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "vllm_dhisparse", site / "vllm_dhisparse",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def run(site: pathlib.Path, cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -P: the current directory is not on sys.path; the venv's start-up hook has imported
    # the repository's package already, so it is dropped and the copy imported instead
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); "
            f"[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('vllm_dhisparse')]; "
            f"import runpy, vllm_dhisparse; assert vllm_dhisparse.__file__.startswith("
            f"{str(site)!r}), vllm_dhisparse.__file__; sys.argv = {list(args)!r}; "
            f"runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-P", "-c", code],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_package_runs_nothing_from_the_repository_layout():
    pkg = ROOT / "vllm_dhisparse"
    found = [f"{p.relative_to(ROOT)}:{n}" for p in pkg.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"""["'](scripts|tests|benchmarks|harness)["']""", line)]
    assert found == [], found


def test_an_installed_package_builds_the_demo_model_and_its_drafter(installed, tmp_path):
    got = run(installed, tmp_path, "vllm_dhisparse.demo_build.model", "--out", "m")
    assert got.returncode == 0, got.stderr[-3000:]
    assert (tmp_path / "m" / "config.json").is_file()
    got = run(installed, tmp_path, "vllm_dhisparse.demo_build.drafters", "dflash2",
              "--target", "m", "--out", "d")
    assert got.returncode == 0, got.stderr[-3000:]
    assert (tmp_path / "d" / "config.json").is_file()


def test_without_the_trained_model_the_demo_names_the_way_out(installed, tmp_path):
    got = run(installed, tmp_path, "vllm_dhisparse.demo")
    assert got.returncode != 0
    assert re.search(r"ships with the repository.*--random-model.*--model DIR",
                     got.stdout + got.stderr), got.stdout[-2000:] + got.stderr[-2000:]
