"""The Figure 6 plot command: derived series and PNG output from a saved series (no server)."""
import json

import pytest

from vllm_dhisparse.tools import plot_residency as P

pytest.importorskip("matplotlib", reason="pip install -e .[plot]")


def _series():
    # 4 samples: request slots 0 -> 2 -> 2 -> 1, coverage undefined -> 50% -> 100%, host share 0.5 then 0
    cols = [(0, 0, 0, 0, 0), (2, 64, 128, 100, 50), (2, 128, 128, 200, 50), (1, 64, 64, 300, 50)]
    return [{"t": float(i), "admitted_requests": a, "ready_optional_rows": r,
             "eligible_history_rows": e, "selected_rows": s, "selected_rows_host": h}
            for i, (a, r, e, s, h) in enumerate(cols)]


def test_derive():
    d = P.derive(_series())
    assert d["req_slots"] == [0, 2, 2, 1]
    assert d["coverage"] == [None, 50.0, 100.0, 100.0]
    assert d["share"] == [None, 50.0, 0.0, 0.0]
    assert P.derive(_series(), window=2)["share"][2] == 25.0


@pytest.mark.parametrize("ext", ["json", "csv"])
def test_plot_from_saved_series(tmp_path, ext):
    path = str(tmp_path / f"s.{ext}")
    P.save_series(_series(), path)
    assert P.load_series(path)[1]["eligible_history_rows"] == 128
    out = tmp_path / "fig6.png"
    assert P.main(["--series", path, "--out", str(out), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_series_is_rejected(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"t": 0, "admitted_requests": 1}]))
    with pytest.raises(ValueError, match="lacks columns"):
        P.load_series(str(path))


def test_parse_exposition():
    text = ("# TYPE vllm:dhisparse_admitted_requests gauge\n"
            'vllm:dhisparse_admitted_requests{engine="0",model_name="a"} 2.0\n'
            'vllm:dhisparse_admitted_requests{engine="1",model_name="b"} 3.0\n'
            "# TYPE vllm:dhisparse_selected_rows counter\n"
            'vllm:dhisparse_selected_rows_total{engine="0",model_name="a"} 10.0\n')
    assert P.parse_exposition(text)["admitted_requests"] == 5.0
    got = P.parse_exposition(text, model_name="a")
    assert got["admitted_requests"] == 2.0 and got["selected_rows"] == 10.0
