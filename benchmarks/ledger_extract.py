"""The ledger's extractors: a result file's headline metrics, one function per benchmark.

Each takes the result JSON and returns ``(config, metrics)``; ``EXTRACTORS`` maps a
benchmark's name (``ledger.py --add BENCHMARK ...``) to its extractor.  They read only the
file's keys and fail (KeyError) where a key is missing rather than invent a value.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

def machine_name(meta: dict) -> str:
    dev = meta.get("device", "?")
    return "CPU x86_64" if dev in ("cpu", "CPU") or str(dev).startswith("CPU") else dev


def _needle(doc: dict) -> tuple[str, dict]:
    s, cells = doc["summary"], doc["cells"]
    n = len(cells) * doc["per_cell"]
    config = "cpu" if machine_name(doc.get("meta", {})).startswith("CPU") else "gpu"
    same_tokens = sum(p["connector"]["token_ids"] == p["resident"]["token_ids"]
                      for p in doc["prompts"])
    metrics = dict(prompts=n, resident=round(s["resident"] * n),
                   connector=round(s["connector"] * n), control=round(s["control"] * n),
                   same_tokens=same_tokens,
                   outputs="identical" if s["connector_equals_resident"] else "different")
    if "resident2_equals_resident" in s:  # vLLM against itself, the like-with-like baseline
        metrics["resident2"] = "identical" if s["resident2_equals_resident"] else "different"
        metrics["max_logprob_diff"] = round(max(_lp_diff(p, "connector") for p in doc["prompts"]), 4)
        metrics["max_logprob_diff_resident2"] = round(max(_lp_diff(p, "resident2")
                                                          for p in doc["prompts"]), 4)
    return config, metrics


def _lp_diff(prompt: dict, arm: str) -> float:
    """Largest logprob difference over the tokens both runs share (after the first token
    that differs, logprobs are of other tokens)."""
    a, b = prompt[arm], prompt["resident"]
    out = 0.0
    for ta, tb, x, y in zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"]):
        if ta != tb:
            break
        out = max(out, abs(x - y))
    return out


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


def _sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits, the precision a headline carries."""
    return float(f"{x:.{digits}g}")


def _overrides(overrides: dict) -> str:
    """A config's suffix for the launcher constants a run set with ``--set`` (none: the
    run's commit's defaults), e.g. ``_many_maxnreg64``."""
    return "".join(f"_{k.strip('_').lower()}{v}" for k, v in sorted(overrides.items()))


def _hierarchy_step(doc: dict) -> tuple[str, dict]:
    p, c = doc["points"][0], doc["config"]
    # --set came with kernel_overrides: a run without the key set no constant
    return (f"b{p['batch']}_h{c['history']}_{'graph' if c['graph'] else 'eager'}"
            + _overrides(c.get("kernel_overrides", {})),
            dict(sessions=p["batch"], context_tokens=c["history"] * c["compress"],
                 step_ms=round(p["step_wall_ms"], 2), host_syncs=p["host_syncs_per_step"]))


def _hierarchy_load(doc: dict) -> tuple[str, dict]:
    """``bench_hierarchy_load.py``: an admission that reclaims (median, its host
    synchronisations), a drain step (median, max), a base step, and the drain steps until
    coverage is back."""
    s = doc["summary"]
    return "graph" if doc["config"]["graph"] else "eager", dict(
        admission_ms=_sig(s["admission_ms_median"]),
        admission_host_syncs=s["admission_host_syncs_median"],
        drain_step_ms=_sig(s["drain"]["step_ms_median"]),
        drain_step_ms_max=_sig(s["drain"]["step_ms_max"]),
        base_step_ms=_sig(s["base"]["step_ms_median"]),
        drain_steps_to_recover=doc["drain_steps_to_recover"])


def _capacity(doc: dict) -> tuple[str, dict]:
    return "cpu", dict(kv_mb=round(doc["kv_cache_bytes"] / 1e6), prompt_tokens=doc["prompt_len"],
                       resident_running=doc["resident"]["max_running"],
                       connector_running=doc["connector"]["max_running"])


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
    return f"kv{doc['kv_cache_memory_bytes'] / 2**30:g}g_rate{doc['rate']:g}", dict(
        max_decoding_resident=r["max_decoding"], max_decoding_connector=c["max_decoding"],
        tokens_per_s_resident=r["output_tokens_per_s"],
        tokens_per_s_connector=c["output_tokens_per_s"],
        host_share_pct=round(100 * c["host_share"], 1))


def _bench_sessions(doc: dict) -> tuple[str, dict]:
    return f"{doc['tokens'] // 1000}k_{doc['budget_bytes'] >> 30}gib", dict(
        resident=doc["resident_sessions"], hierarchy=doc["hierarchy_sessions"],
        ratio=round(doc["ratio"], 2), predicted_ratio=round(doc["predicted_ratio"], 2))


def _cpu_server(doc: dict) -> tuple[str, dict]:
    if "latency" in doc:
        lat = doc["latency"]
        return "latency", dict(itl_ratio_1=round(lat["ratio_1"], 2),
                               itl_ratio_4=round(lat["ratio_4"], 2))
    return "capacity", {f"max_running_{arm}_{n}": r[arm]["max_running"]
                        for n, r in doc["capacity"].items() for arm in ("resident", "connector")}


def _kv_layout(doc: dict) -> tuple[str, dict]:
    return "cpu", {f"most_sessions_ratio_{name}": s["most_sessions_ratio"]
                   for name, s in doc["shapes"].items()}


def _multi_turn(doc: dict) -> tuple[str, dict]:
    """Prompt tokens computed per later turn (mean over conversations and turns 2..T), by
    arm; requests running at once and the wall time of the whole workload, by arm; the
    connector's host hits; turns whose tokens equal resident serving's."""
    c, rows, arms = doc["config"], doc["per_turn"], doc["arms"]

    def later(arm: str, key: str) -> float:
        sel = [r for r in rows if r["arm"] == arm and r["turn"] > 1]
        return round(sum(r[key] * r["conversations"] for r in sel)
                     / max(1, sum(r["conversations"] for r in sel)), 1)
    out = {f"computed_per_later_turn_{arm}": later(arm, "computed_tokens") for arm in arms}
    out.update({f"max_running_{arm}": max(a["running"]) for arm, a in arms.items()})
    out.update({f"wall_s_{arm}": round(a["wall_s"]) for arm, a in arms.items()})
    hp = arms.get("connector", {}).get("host_prefix") or {}
    src = {arm: a["prompt_tokens_by_source"] for arm, a in arms.items()}
    out.update(host_tokens=src["connector"].get("external_kv_transfer", 0),
               cache_tokens_connector=src["connector"].get("local_cache_hit", 0),
               cache_tokens_resident=src["resident"].get("local_cache_hit", 0),
               later_turns=sum(r["conversations"] for r in rows
                               if r["arm"] == "resident" and r["turn"] > 1))
    out.update(host_hits=hp.get("loads", 0), turns=len(arms["resident"]["turns"]),
               same_tokens_connector=sum(r["same_tokens_as_resident"] or 0 for r in rows
                                         if r["arm"] == "connector"))
    return f"c{c['conversations']}_{c['first_tokens']}tok_kv{c['kv_cache_bytes'] // 10**6}mb", out


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
    return "all", out


def _bench_gather(doc: dict) -> tuple[str, dict]:
    """``bench_gather.py``: the Triton row gather against one pinned ``copy_`` of as many
    bytes, over every row size, batch and miss count."""
    pts = doc["points"]
    ratios = [p["triton_over_memcpy"] for p in pts]
    return "gpu", dict(cases=len(pts), correct=sum(p["correct"] for p in pts),
                       pinned_copy_gbps=_sig(doc["pinned_h2d"]["median_gbps"]),
                       triton_gbps_max=_sig(max(p["triton"]["gbps"] for p in pts)),
                       triton_over_memcpy_min=_sig(min(ratios)),
                       triton_over_memcpy_max=_sig(max(ratios)))


def _bench_host_reads(doc: dict) -> tuple[str, dict]:
    """``bench_host_reads.py``: GB/s of scattered zero-copy reads, 512 rows per batch row at
    batch 8 and 32 (where the page kinds differ), by how the host pool was allocated."""
    out = dict(errors=sum(len(k["errors"]) for k in doc["kinds"]))
    for kind in doc["kinds"]:
        gbps = {(c["batch"], c["rows"]): c["gbps"] for c in kind["cells"]}
        for batch in (8, 32):
            out[f"{kind['kind']}_gbps_batch{batch}_rows512"] = _sig(gbps[(batch, 512)])
    return f"pool_{doc['config']['pool_bytes'] >> 30}gib", out


def _bench_resolve(doc: dict) -> tuple[str, dict]:
    """``bench_resolve.py``, by the paths a file holds: the miss path's fitted bandwidth over
    pinned ``copy_`` and disjoint over shared selections; the no-miss path's calls at batch
    8, B = 4096 (the 18.7 us target) and its direct calls over the scanning ones."""
    targets = doc["targets"]
    out = dict(targets=len(targets), targets_passed=sum(t["passed"] for t in targets),
               correctness_failures=len(doc["correctness_failures"]))
    paths = []
    if doc["miss_path"]:
        paths.append("miss")
        fits = doc["miss_fits"]
        out.update(fit_over_pinned_min=_sig(min(f["ratio_to_pinned"] for f in fits)),
                   fit_over_pinned_max=_sig(max(f["ratio_to_pinned"] for f in fits)),
                   disjoint_over_shared_min=_sig(min(f["disjoint_over_shared"] for f in fits)),
                   disjoint_over_shared_max=_sig(max(f["disjoint_over_shared"] for f in fits)))
    if doc["nomiss_path"]:
        paths.append("nomiss")
        us = {(p["batch"], p["budget"], p["path"]): 1e3 * p["median_ms"]
              for p in doc["nomiss_path"] if p["misses_per_request"] == 0}
        out.update(direct_us_batch8_b4096=_sig(us[(8, 4096, "direct")]),
                   scan_us_batch8_b4096=_sig(us[(8, 4096, "scan")]),
                   direct_over_scan_min=_sig(min(us[(b, B, "direct")] / t
                                                 for (b, B, path), t in us.items()
                                                 if path == "scan")))
    return "_".join(paths) + _overrides(doc["kernel_overrides"]), out


def _bench_sglang(doc: dict) -> tuple[str, dict]:
    """``bench_sglang.py``: SGLang's time over ours per cell (batch x miss share); the cells
    where ours is not slower, the least ratio and the two 5 % cells that bound it."""
    c = doc["config"]
    ratio = {(p["batch"], round(100 * p["miss_frac"])): p["speedup"] for p in doc["points"]}
    return f"k{c['top_k']}_b{c['budget']}" + _overrides(doc["sglang"]["kernel_overrides"]), dict(
        cells=len(ratio), cells_not_slower=sum(r >= 1 for r in ratio.values()),
        sglang_over_ours_min=_sig(min(ratio.values())),
        sglang_over_ours_batch8_miss5=_sig(ratio[(8, 5)]),
        sglang_over_ours_batch160_miss5=_sig(ratio[(160, 5)]),
        correctness_failures=len(doc["correctness_failures"]))


def _cpu_step_parts(doc: dict) -> tuple[str, dict]:
    """``cpu_step_parts.py``: medians of a decode step's forward and of one c4a layer's
    attention call, resident against routed, and of the connector's resolve per call."""
    res, con = doc["arms"]["resident"], doc["arms"]["connector"]
    med = lambda arm, name: _sig(arm[name]["median_ms"], 4)  # noqa: E731
    return "cpu", dict(
        forward_ms_resident=med(res, "GPUModelRunner.execute_model"),
        forward_ms_connector=med(con, "GPUModelRunner.execute_model"),
        c4a_layer_ms_resident=med(res, "upstream attention c4 T=1"),
        c4a_layer_ms_connector=med(con, "routed attention c4 T=1"),
        resolve_ms=med(con, "StepContext.resolve"))


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
        llm_serve_max_logprob_diff=_sig(cmp["max_abs_logprob_diff"]))


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


def _load_step(doc: dict) -> tuple[str, dict]:
    """``load_step.py``: the host-fetched share of selected rows in the high phase, residency
    on against off, the least coverage with it on, and whether both arms' outputs agree."""
    conc = doc["concurrency"]
    phases = doc["summary"]["phases"]
    high = phases[str(conc.index(max(conc, key=int)))]
    return "c" + "_".join(conc), dict(
        host_share_pct_on=round(100 * high["host_share_on"], 1),
        host_share_pct_off=round(100 * high["host_share_off"], 1),
        min_coverage_on=min(p["min_coverage_on"] for p in phases.values()),
        outputs_identical=doc["summary"]["outputs_identical_on_vs_off"])


def _memory_accounting(doc: dict) -> tuple[str, dict]:
    """``memory_accounting.py``: GiB per session, resident against the hierarchy's required
    state, for GLM-5.3 at 100K tokens (next to the paper's Table 1) and for
    DeepSeek-V4.1-Flash at 500K (what bench_sessions.py's ratio is predicted from)."""
    glm = doc["shapes"]["GLM-5.3 (d_KV=576 B)"]["100000"]["table_gib"]
    v4 = doc["shapes"]["DeepSeek-V4.1-Flash (partly assumed)"]["500000"]["table_gib"]
    return "per_session", dict(
        glm_resident_gib_100k=_sig(glm["resident"], 4),
        glm_adaptive_gib_100k=_sig(glm["adaptive"], 4),
        paper_adaptive_gib_100k=doc["paper_table1_gib"]["100000"]["adaptive"],
        v4_flash_resident_gib_500k=_sig(v4["resident"], 4),
        v4_flash_adaptive_gib_500k=_sig(v4["adaptive"], 4))


def _slug(name: str) -> str:
    return re.sub(r"\W+", "_", name.split(" (")[0]).strip("_").lower()


def _staging_memory(doc: dict) -> tuple[str, dict]:
    """``staging_memory.py``: MB of device memory the hierarchy allocates per configuration,
    with per-request staging (``before``) and the shared arena (``after``)."""
    return "demo_model", {f"{_slug(r['config'])}_mb_{side}": round(r["device_bytes"] / 1e6, 2)
                          for side in ("before", "after") for r in doc[side]}


def _spec_memory(doc: dict) -> tuple[str, dict]:
    """``spec_memory.py``: a request's draft KV at any step in vLLM's blocks against the
    hierarchy's draft ring, the verification staging an engine reserves, and the runs'
    tokens against speculation off."""
    kv, sizes, same = doc["draft_kv"], doc["spec_sizes"], doc["check"]["same_tokens"]
    return f"{sizes['preset']}_k{sizes['num_speculative_tokens']}", dict(
        draft_kv_mb_resident=round(kv["resident"]["bytes_any_step"] / 1e6, 2),
        draft_kv_mb_hierarchy=round(kv["hierarchy"]["bytes_any_step"] / 1e6, 2),
        staging_reserved_mb=round(doc["staging"]["reserved_bytes"] / 1e6, 2),
        same_tokens=f"{sum(same)}/{len(same)}")


def _tune_chunks(doc: dict) -> tuple[str, dict]:
    """``tune_chunks.py``: miss calls at large B, us per call at batch 8 and 160 and the
    smallest and largest B, with one set of launcher constants per run (its config)."""
    pts = doc["points"]
    variants = {json.dumps(p["variant"], sort_keys=True) for p in pts}
    if len(variants) != 1:
        raise ValueError(f"a run of {len(variants)} variants: one record per variant")
    us = {(p["batch"], p["budget"]): p["median_us"] for p in pts}
    out = {f"us_batch{b}_b{B}": _sig(us[(b, B)], 4) for b in (8, 160) for B in (4096, 16384)}
    out["checked"] = all(p["ok"] for p in pts)
    return _overrides(pts[0]["variant"]).lstrip("_") or "defaults", out


EXTRACTORS = {"kv_layout": _kv_layout, "multi_turn": _multi_turn, "needle": _needle,
              "gpu_make_test": _gpu_make_test,
              "gpu_host_prefix": _gpu_host_prefix,
              "gpu_host_prefix_bytes": _gpu_host_prefix_bytes,
              "gpu_host_prefix_package": _gpu_package_scenarios,
              "gpu_serve_metrics": _gpu_serve_metrics,
              "gpu_connector_audit": _gpu_audit,
              "bench_hierarchy_step": _hierarchy_step, "capacity": _capacity,
              "gpu_connector": _gpu_connector, "gpu_capacity": _gpu_capacity,
              "bench_sessions": _bench_sessions, "cpu_server": _cpu_server,
              "bench_hierarchy_load": _hierarchy_load, "bench_gather": _bench_gather,
              "bench_host_reads": _bench_host_reads, "bench_resolve": _bench_resolve,
              "bench_sglang": _bench_sglang, "cpu_step_parts": _cpu_step_parts,
              "gpu_correctness": _gpu_correctness, "gpu_engine": _gpu_engine,
              "gpu_fmla_routed": _gpu_fmla_routed, "gpu_fmla_decode": _gpu_fmla_decode,
              "load_step": _load_step, "memory_accounting": _memory_accounting,
              "staging_memory": _staging_memory, "spec_memory": _spec_memory,
              "tune_chunks": _tune_chunks}
