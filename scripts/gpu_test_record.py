"""One record of a ``make test-gpu`` run, from what pytest leaves behind.

    PYTEST_ADDOPTS="--junitxml=J.xml --basetemp=T" make test-gpu      # on the GPU machine
    python scripts/gpu_test_record.py --junit J.xml [J2.xml ...] --basetemp T [T2 ...] \\
        --commit SHA --out benchmarks/results/gpu_make_test_<date>_<commit>.json

Reads every test's outcome and time from the JUnit files and, from each test's
``gpu_connector.json`` (``scripts/gpu_connector.py`` writes one per test under pytest's
temporary folder), the numbers its assertions are about: resident against itself and the
connector against resident, the host share of selections, the routed-decode audit, the
host prefix byte comparison, a speculative test's method, vLLM's draft counters and the
connector class its command named.  A test run split over several calls (one call's time limit)
passes several JUnit files and folders.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def outcomes(junit_files: list[str]) -> list[dict]:
    tests = []
    for path in junit_files:
        for case in ET.parse(path).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            tests.append(dict(name=case.get("name"), seconds=round(float(case.get("time")), 1),
                              outcome="failed" if failed else "skipped" if skipped
                              else "passed"))
    return tests


def facts(doc: dict) -> dict:
    """What the test in question asserts on, from one gpu_connector.json."""
    arms, out = doc["arms"], {}
    conn = arms.get("connector", {})
    census = conn.get("scenarios", {}).get("batch", {}).get("census")
    if census:
        out["host_share"] = round(census["host"] / (census["direct"] + census["hot"]
                                                    + census["host"]), 3)
    cmp = doc.get("comparisons", {})
    if "resident_vs_itself" in cmp:
        out["resident_vs_itself_identical"] = cmp["resident_vs_itself"]["identical"]
        out["resident_vs_itself_max_logprob_diff"] = round(
            cmp["resident_vs_itself"]["max_logprob_diff"], 4)
        out["connector_vs_resident_max_logprob_diff"] = round(max(
            c["max_logprob_diff"] for c in cmp["connector_vs_resident"].values()), 4)
    if "audit_serving" in conn:
        out["audit"] = dict(conn["audit_serving"], cudagraph_mode=conn["engine"]["cudagraph_mode"],
                            routed_selected_at_start=conn["routed_selected_at_start"])
    if doc.get("spec"):
        out["spec"] = dict(method=doc["spec"], connector_class=doc.get("connector_class"),
                           **conn.get("spec_counters", {}))
    hb = conn.get("scenarios", {}).get("host_prefix_bytes")
    if hb:
        out["host_prefix_bytes"] = dict(loaded_tokens=hb["loaded_tokens"], **{
            k: f"{v['y_eq_x']}/{v['units']}" for k, v in hb["compared"].items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", nargs="+", required=True)
    ap.add_argument("--basetemp", nargs="+", required=True)
    ap.add_argument("--commit", required=True, help="the tree the GPU machine ran")
    ap.add_argument("--device", default="", help="the GPU, as nvidia-smi names it")
    ap.add_argument("--versions", default="", help="driver, torch, vLLM, Triton")
    ap.add_argument("--date", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    tests = outcomes(args.junit)
    # pytest's temporary folder per test: the name's first 30 characters and a number in
    # the order the tests ran (parametrized tests share the stem)
    for base, junit in zip(args.basetemp, args.junit):
        ran = outcomes([junit])
        for stem in dict.fromkeys(t["name"][:30] for t in ran):
            docs = sorted(glob.glob(os.path.join(base, stem + "*", "gpu_connector.json")),
                          key=lambda p: int(os.path.basename(os.path.dirname(p))[30:] or 0))
            mine = [t for t in tests if t["name"][:30] == stem and
                    t["name"] in {r["name"] for r in ran}]
            for t, path in zip(mine, docs):
                with open(path) as f:
                    t.update(facts(json.load(f)))
    record = dict(date=args.date, commit=args.commit, device=args.device,
                  versions=args.versions, command="make test-gpu",
                  passed=sum(t["outcome"] == "passed" for t in tests), tests=tests)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    return 0 if record["passed"] == len(tests) else 1


if __name__ == "__main__":
    sys.exit(main())
