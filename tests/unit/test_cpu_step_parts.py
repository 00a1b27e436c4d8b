"""benchmarks/cpu_step_parts.py's timers: they keep what vLLM's start-up checks read (a
method's signature) and the method's result and errors, and record every call."""
import inspect
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import cpu_step_parts as P  # noqa: E402


class Layer:
    compress_ratio = 4

    def forward_mqa(self, q, kv, positions, output):
        if q == "bad":
            raise ValueError("bad q")
        return q


def test_a_timed_method_keeps_its_signature_result_and_errors():
    calls = []
    timed = P._timed(Layer.forward_mqa, lambda key, dt: calls.append((key, dt)),
                     lambda self, q, *a: f"c{self.compress_ratio}")
    assert inspect.signature(timed) == inspect.signature(Layer.forward_mqa)
    assert timed(Layer(), "q", None, None, None) == "q"
    with pytest.raises(ValueError, match="bad q"):
        timed(Layer(), "bad", None, None, None)
    assert [k for k, _ in calls] == ["c4", "c4"] and all(dt >= 0 for _, dt in calls)


def test_summary_is_per_part_calls_median_and_total():
    got = P.summarize({"b": [0.001, 0.003, 0.002], "a": [0.004]})
    assert list(got) == ["a", "b"]
    assert got["b"] == dict(calls=3, median_ms=pytest.approx(2.0), total_ms=pytest.approx(6.0))


def test_out_is_required(capsys):
    with pytest.raises(SystemExit):
        P.main([])
    assert "--out is required" in capsys.readouterr().err
