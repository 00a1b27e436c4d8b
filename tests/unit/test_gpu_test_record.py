"""scripts/gpu_test_record.py: a ``make test-gpu`` run split over two calls becomes one
record, each test matched to its own gpu_connector.json (parametrized tests share the
temporary folder's stem and are told apart by pytest's running number)."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_test_record  # noqa: E402

AUDIT = "test_every_routed_decode_call_equals_upstreams_in_the_engine"


def junit(path, cases):
    body = "".join(f'<testcase classname="t" name="{n}" time="{t}">{extra}</testcase>'
                   for n, t, extra in cases)
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return str(path)


def audit_doc(mode, replayed):
    return {"arms": {"connector": {
        "audit_serving": {"calls": 10, "equal": 10, "replayed_calls": replayed},
        "engine": {"cudagraph_mode": mode}, "routed_selected_at_start": 0,
        "scenarios": {"batch": {"census": {"direct": 1, "hot": 1, "host": 2}}}}}}


def test_two_calls_make_one_record_with_each_tests_numbers(tmp_path):
    a = junit(tmp_path / "a.xml", [("test_a_host_prefix_hit_loads", "60.0", "")])
    b = junit(tmp_path / "b.xml", [(f"{AUDIT}[eager]", "70.0", ""),
                                   (f"{AUDIT}[full_graphs]", "71.0", "<failure/>")])
    ta, tb = tmp_path / "ta", tmp_path / "tb"
    (ta / "test_a_host_prefix_hit_loads0").mkdir(parents=True)
    (ta / "test_a_host_prefix_hit_loads0" / "gpu_connector.json").write_text(json.dumps(
        {"arms": {"connector": {"scenarios": {"host_prefix_bytes": {
            "loaded_tokens": 256, "compared": {"c4a": {"units": 64, "y_eq_x": 64}}}}}}}))
    for i, (mode, replayed) in enumerate([("NONE", 0), ("FULL_AND_PIECEWISE", 9)]):
        d = tb / f"{AUDIT[:30]}{i}"
        d.mkdir(parents=True)
        (d / "gpu_connector.json").write_text(json.dumps(audit_doc(mode, replayed)))
    out = tmp_path / "r.json"
    rc = gpu_test_record.main(["--junit", a, b, "--basetemp", str(ta), str(tb),
                               "--commit", "abc1234", "--date", "2026-12-06",
                               "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rc == 1 and rec["passed"] == 2  # one test failed: the record says so
    by = {t["name"]: t for t in rec["tests"]}
    assert by["test_a_host_prefix_hit_loads"]["host_prefix_bytes"] == {"loaded_tokens": 256,
                                                                       "c4a": "64/64"}
    assert by[f"{AUDIT}[eager]"]["audit"]["cudagraph_mode"] == "NONE"
    assert by[f"{AUDIT}[full_graphs]"]["audit"]["replayed_calls"] == 9
    assert by[f"{AUDIT}[full_graphs]"]["outcome"] == "failed"
    assert by[f"{AUDIT}[eager]"]["host_share"] == 0.5
