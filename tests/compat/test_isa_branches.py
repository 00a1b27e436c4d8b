"""The ISA-dependent compat tests also pass on an x86 CPU without AVX-512 (AVX2 only).

The session (tests/isa.py) takes vLLM's AVX-512 branches wherever the CPU has AVX-512;
this runs the same modules again in a subprocess at the AVX2 level (torch reports no
AVX-512 / AMX, so vLLM loads its AVX2 library and refuses FP8 KV), where they take the
AVX2 branches.  A session at the AVX2 level already is that run.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests import isa

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["tests/compat/test_cpu_attn_kv_dtype.py", "tests/compat/test_eager_v4_attention_ops.py",
           "tests/compat/test_eager_v4_model_ops.py"]
RUN = """
import sys, pytest, torch
assert not torch.cpu._is_avx512_supported(), "AVX2 emulation not in effect"
rc = pytest.main(sys.argv[1:])
libs = {line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line}
print("vLLM library:", sorted(libs))
sys.exit(rc)
"""


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                    reason="emulates an x86 CPU and reads /proc/self/maps")
@pytest.mark.skipif("avx2" not in isa.others(), reason="the session runs at the AVX2 level")
def test_compat_tests_pass_on_avx2_only_cpu():
    env = {**os.environ, **isa.env("avx2")}
    proc = subprocess.run([sys.executable, "-c", RUN, "-q", "-p", "no:cacheprovider", *MODULES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "vLLM library: ['_C_AVX2.abi3.so']" in out, out[-2000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]
