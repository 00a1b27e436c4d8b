"""The ISA-dependent compat tests also pass on an x86 CPU without AVX-512 (AVX2 only).

On a machine with AVX-512 the native run takes vLLM's AVX-512 branches; this runs the
same modules again in a subprocess under tests/isa_avx2 (torch reports no AVX-512 /
AMX, so vLLM loads its AVX2 library and refuses FP8 KV), where they take the AVX2
branches.  On a machine without AVX-512 the native run already is that run.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

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
@pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                    reason="no AVX-512 here: the native run is the AVX2 run")
def test_compat_tests_pass_on_avx2_only_cpu():
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "isa_avx2"),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", RUN, "-q", "-p", "no:cacheprovider", *MODULES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "vLLM library: ['_C_AVX2.abi3.so']" in out, out[-2000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]
