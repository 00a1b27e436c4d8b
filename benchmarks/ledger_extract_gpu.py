"""The ledger's extractors of the GPU results (scripts/gpu_*.py, benchmarks/gpu_*.py): the
in-engine audits and scenarios, capacity, host prefix bytes, metrics and make test-gpu runs,
and the GPU layer's correctness and FlashMLA checks.  Each takes the result JSON and returns
``(config, metrics)``; ``GPU_EXTRACTORS`` names them by benchmark.
"""
from __future__ import annotations

import os

from pathlib import Path


def sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits, the precision a headline carries."""
    return float(f"{x:.{digits}g}")


def _gpu_audit(doc: dict) -> tuple[str, dict]:
    """Calls that serve requests; vLLM's warm-up (dummy batches before the first request,
    of which the routed decode serves none) apart."""
    arm = doc["arms"]["connector"]
    t, extra = arm["worker_totals"], doc["extra_config"]
    selected = t["direct"] + t["hot"] + t["host"]
    audit = arm["audit"]
    start = arm.get("audit_at_start")
    if start is None:  # an eager run that counted warm-up only by the scenarios' calls;
        # any unequal call is put among the serving ones
        warm = audit["calls"] - sum(s.get("routed_decode_python_eager", 0)
                                    for s in arm["scenarios"].values())
        start = dict(calls=warm, equal=warm, tokens=0, replayed_calls=0)  # tokens unknown
    metrics = dict(
        calls=audit["calls"] - start["calls"], equal=audit["equal"] - start["equal"],
        replayed_calls=audit.get("replayed_calls", 0) - start["replayed_calls"],
        warmup_calls=start["calls"], warmup_equal=start["equal"],
        tokens=audit["tokens"] - start["tokens"],  # warm-up's dummy tokens apart
        host_share_pct=round(100 * t["host"] / selected, 1),
        model=Path(doc["model"]).name, hot_cache_rows=extra.get("hot_cache_rows"),
        device_window_tokens=extra.get("device_window_tokens"))
    config = arm["engine"]["cudagraph_mode"].lower()
    if extra.get("history_block_tokens"):  # vLLM's history in wider blocks: another layout
        config += f"_history{extra['history_block_tokens']}"
        metrics["history_block_tokens"] = extra["history_block_tokens"]
    spec = doc.get("speculative_config")
    if spec:  # gpu_connector.py --spec: K draft tokens verified per request and step
        # a DSpark drafter replaying an earlier run's outputs accepts more than one built
        # from the prompts: another configuration
        config += f"_{doc['spec']}_k{spec['num_speculative_tokens']}" + (
            "_replayed" if doc.get("spec_ref") else "")
        counters = arm.get("spec_counters") or {}
        metrics.update({f"spec_{k}": counters.get(k) for k in
                        ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
    return config, metrics


def _gpu_connector(doc: dict) -> tuple[str, dict]:
    cmp = doc["comparisons"]
    same = lambda pair: sum(c["identical"] for c in cmp[pair].values())  # noqa: E731
    census = doc["arms"]["connector"]["scenarios"]["batch"]["census"]
    return "graphs", dict(
        resident_bitwise_with_itself=cmp["resident_vs_itself"]["identical"],
        scenarios=len(cmp["connector_vs_resident"]), identical_to_resident=same(
            "connector_vs_resident"), errors=sum("error" in a for a in doc["arms"].values()),
        batch_host_share_pct=round(100 * census["host"] / (census["direct"] + census["hot"]
                                                          + census["host"]), 1))


def _gpu_capacity(doc: dict) -> tuple[str, dict]:
    r, c = doc["arms"]["resident"], doc["arms"]["connector"]
    shape = doc.get("shape", "demo")
    wide = (doc.get("extra_config") or {}).get("history_block_tokens")
    chunk = doc.get("max_num_batched_tokens")
    config = (f"kv{doc['kv_cache_memory_bytes'] / 2**30:g}g_rate{doc['rate']:g}"
              + (f"_{shape}" if shape != "demo" else "") + (f"_history{wide}" if wide else "")
              + (f"_chunk{chunk}" if chunk else "")
              + "".join(f"_{k}={v}" for k, v in sorted((doc.get("engine_args") or {}).items())))
    return config, dict(
        max_decoding_resident=r["max_decoding"], max_decoding_connector=c["max_decoding"],
        tokens_per_s_resident=r["output_tokens_per_s"],
        tokens_per_s_connector=c["output_tokens_per_s"],
        host_share_pct=round(100 * c["host_share"], 1))


def _gpu_host_prefix(doc: dict) -> tuple[str, dict]:
    """``gpu_connector.py --scenarios host_prefix``: the second turn's tokens loaded from
    host, and its outputs against resident's and resident's against a second resident's."""
    arms, cmp = doc["arms"], doc["comparisons"]
    sc = {a: arms[a]["scenarios"]["host_prefix"] for a in arms}
    cached = {a: sum(o["num_cached_tokens"] for o in s["outputs"].values()) for a, s in sc.items()}
    out = dict(tokens_loaded=sc["connector"]["host_prefix"]["tokens_loaded"],
               cached_connector=cached["connector"], cached_resident=cached["resident"])
    for pair in ("connector_vs_resident", "resident_vs_resident2"):
        c = cmp[pair]["host_prefix"]
        out[f"{pair}_tokens_equal"] = not c["tokens_differ"]
        out[f"{pair}_max_logprob_diff"] = round(c["max_logprob_diff"], 4)
    return "second_turn", out


def _connector_class(doc: dict) -> str:
    """The connector class a ``gpu_connector.py`` run served with; runs before the JSON named
    it were of the package's class where the package accepted the configuration."""
    name = doc.get("connector_class", "DHiSparseConnector")
    if name != "DHiSparseConnector":
        raise ValueError(f"a run of {name}, not the package's class")
    return "package_class"


def _gpu_host_prefix_bytes(doc: dict) -> tuple[str, dict]:
    """``gpu_connector.py --scenarios host_prefix_bytes``: a hit's loaded KV against the blocks
    vLLM computed (y against x), and vLLM's second prefill against its first (z against x)."""
    r = doc["arms"]["connector"]["scenarios"]["host_prefix_bytes"]
    out = dict(loaded_tokens=r["loaded_tokens"], loaded_equal_computed=r["loaded_equal_computed"])
    for kind, c in r["compared"].items():
        out[f"{kind}_equal"] = f"{c['y_eq_x']}/{c['units']}"
        out[f"{kind}_vllm_again_equal"] = f"{c['x_eq_z']}/{c['units']}"
    if "y_blocks_where_x_had_them" in r:
        out["y_blocks_where_x_had_them"] = r["y_blocks_where_x_had_them"]
    return _connector_class(doc), out


def _gpu_package_scenarios(doc: dict) -> tuple[str, dict]:
    """``gpu_connector.py --arms resident,connector``: per scenario, the outputs compared,
    whether the connector's tokens equal resident's (false where a scenario failed or
    compared nothing), and the largest logprob gap."""
    _connector_class(doc)
    out = {}
    for s, c in doc["comparisons"]["connector_vs_resident"].items():
        out[f"{s}_compared"] = c.get("compared", 0)
        out[f"{s}_tokens_equal"] = c.get("compared", 0) > 0 and not c.get("tokens_differ", [1])
        out[f"{s}_max_logprob_diff"] = round(c.get("max_logprob_diff", float("nan")), 4)
    scen = doc["arms"]["connector"]["scenarios"]
    hp = scen.get("host_prefix", {}).get("host_prefix") or {}
    out["tokens_loaded"] = hp.get("tokens_loaded", 0)
    pre = scen.get("preempt", {}).get("host_prefix")
    if pre:  # counters after the preemption scenario (the engine's whole run)
        out.update(captured_after_preempt=pre["captured"],
                   capture_failed_after_preempt=pre["capture_failed"])
    names = sorted(doc["comparisons"]["connector_vs_resident"])
    config = "host_prefix_package" if names == ["abort", "host_prefix", "preempt"] else \
        "host_prefix_package_" + "_".join(names)
    return config, out


def _gpu_serve_metrics(doc: dict) -> tuple[str, dict]:
    """``gpu_connector.py --arms serve-connector``: the pass key, and the counters of the
    ``/metrics`` scrape taken once the requests have ended (summed over label sets)."""
    _connector_class(doc)
    arm = doc["arms"]["serve-connector"]
    got: dict[str, float] = {}
    for line in arm.get("metrics", []):
        name = line.partition("{")[0]
        if name.endswith("_total"):
            key = name.split("dhisparse_", 1)[-1]
            got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[-1])
    missing = [k for k in ("admissions_total", "selected_rows_total",
                           "selected_rows_host_total") if k not in got]
    if missing:
        raise ValueError(f"the scrape lacks {missing}")
    return "serve_idle_scrape", dict(
        passkey_answered=arm.get("passkey_answered"), admissions=got["admissions_total"],
        selected_rows=got["selected_rows_total"],
        selected_rows_host=got["selected_rows_host_total"])


def _gpu_make_test(doc: dict) -> tuple[str, dict]:
    """``scripts/gpu_test_record.py``: a whole ``make test-gpu`` run, its tests' outcomes
    and the numbers they assert on."""
    tests = doc["tests"]
    graphs = [t["audit"] for t in tests if t.get("audit", {}).get("replayed_calls")]
    hb = [t["host_prefix_bytes"] for t in tests if "host_prefix_bytes" in t]
    out = dict(passed=doc["passed"], tests=len(tests),
               seconds=round(sum(t["seconds"] for t in tests)))
    if graphs:
        out.update(graph_calls_equal=graphs[0]["equal"], graph_calls=graphs[0]["calls"],
                   graph_calls_replayed=graphs[0]["replayed_calls"])
    if hb:
        out.update(host_prefix_c4a_rows=hb[0]["c4a"], host_prefix_full_blocks=hb[0]["full"],
                   host_prefix_window_blocks=hb[0]["sliding"])
    for t in tests:  # speculative audits: calls equal, drafts accepted, the class that ran
        if "spec" in t and "audit" in t and "num_draft_tokens" in t["spec"]:
            m = t["spec"]["method"]
            out[f"spec_{m}_calls"] = f"{t['audit']['equal']}/{t['audit']['calls']}"
            out[f"spec_{m}_accepted"] = (f"{t['spec']['num_accepted_tokens']}/"
                                         f"{t['spec']['num_draft_tokens']}")
            out[f"spec_{m}_class"] = t["spec"]["connector_class"]
    return "all", out


def _gpu_correctness(doc: dict) -> tuple[str, dict]:
    """``gpu_correctness.py``: resolve + gather against the torch references, configurations
    and calls (each configuration's last on corrupted tables) that matched."""
    calls = [c for case in doc["cases"] for c in case["calls"]]
    return "small" if doc["small"] else "real_sizes", dict(
        configurations=doc["configurations"],
        configurations_passed=sum(c["passed"] for c in doc["cases"]),
        calls=len(calls), calls_ok=sum(c["ok"] for c in calls), complete=doc["complete"],
        seconds=round(doc["seconds"]))


def _gpu_engine(doc: dict) -> tuple[str, dict]:
    """``scripts/gpu_engine.py``: vLLM's GPU engine serving the model resident through ``LLM``
    and ``vllm serve``: the pass key in each, FULL CUDA graphs, the two arms alike."""
    arms, cmp = doc["arms"], doc["llm_vs_serve"]
    return "resident", dict(
        passkey_llm=arms["llm"]["passkey"]["answered"],
        passkey_serve=arms["serve"]["passkey"]["answered"],
        full_cuda_graphs=all(a["full_cuda_graphs"] for a in arms.values()),
        llm_serve_same_tokens=cmp["same_tokens"],
        llm_serve_max_logprob_diff=sig(cmp["max_abs_logprob_diff"]))


def _gpu_fmla_routed(doc: dict) -> tuple[str, dict]:
    """``gpu_fmla_routed.py --parts``: the cases bitwise against FlashMLA on vLLM's blocks,
    the routing case, the graph replays, the timing per layer call (us, graph replays);
    the parts a run holds name its config. A refused timing part fails the run."""
    out, parts = {}, []
    if doc["cases"]:
        parts.append("checks")
        out.update(cases=len(doc["cases"]), cases_bitwise=sum(c["passed"] for c in doc["cases"]),
                   negative_controls_differ=sum(c["negative_control_differs"]
                                                for c in doc["cases"]))
    for part in ("routing", "graph"):
        if part in doc:
            parts.append(part)
            ok = [s["equal"] for s in doc[part]["steps"]] if part == "routing" \
                else doc[part]["replays"]
            out[f"{part}_equal"] = f"{sum(ok)}/{len(ok)}"
    t = doc.get("timing", {})
    if "error" in t:
        out["timing_refused"] = True
    elif t:
        parts.append("timing")
        out.update(fmla_us=round(1e3 * t["graph_resident_ms"]),
                   routed_us=round(1e3 * t["graph_routed_ms"]),
                   routing_overhead_us=round(1e3 * t["routing_overhead_ms"]),
                   target_us=round(1e3 * t["target_ms"]), within_target=t["within_target"])
    out["passed"] = doc["passed"]
    return "_".join(parts), out


def _gpu_fmla_decode(doc: dict) -> tuple[str, dict]:
    """``gpu_fmla_decode.py``: the layer's routed decode call, graph-captured and replayed
    step after step, against FlashMLA on vLLM's blocks."""
    d = doc["decode"]
    equal = [s["equal"] for s in d["steps"]]
    return "graph", dict(batch=d["batch"], max_queries=d["max_queries"],
                         steps_equal=f"{sum(equal)}/{len(equal)}",
                         invalid_selections=d["invalid_selections"], passed=doc["passed"])


def _gpu_pytest(doc: dict) -> tuple[str, dict]:
    """One GPU test file's pytest summary (its output beside the record)."""
    return os.path.splitext(os.path.basename(doc["tests"]))[0], dict(
        passed=doc["passed"], failed=doc["failed"], skipped=doc["skipped"])


GPU_EXTRACTORS = {"gpu_make_test": _gpu_make_test, "gpu_pytest": _gpu_pytest, "gpu_host_prefix": _gpu_host_prefix,
                  "gpu_host_prefix_bytes": _gpu_host_prefix_bytes,
                  "gpu_host_prefix_package": _gpu_package_scenarios,
                  "gpu_serve_metrics": _gpu_serve_metrics, "gpu_connector_audit": _gpu_audit,
                  "gpu_connector": _gpu_connector, "gpu_capacity": _gpu_capacity,
                  "gpu_correctness": _gpu_correctness, "gpu_engine": _gpu_engine,
                  "gpu_fmla_routed": _gpu_fmla_routed, "gpu_fmla_decode": _gpu_fmla_decode}
