"""The ledger's extractors: a result file's headline metrics, one function per benchmark
(the GPU results' in ``ledger_extract_gpu.py``).

Each takes the result JSON and returns ``(config, metrics)``; ``EXTRACTORS`` maps a
benchmark's name (``ledger.py --add BENCHMARK ...``) to its extractor.  They read only the
file's keys and fail (KeyError) where a key is missing rather than invent a value.
"""
from __future__ import annotations

import json
import re

from benchmarks.ledger_extract_gpu import GPU_EXTRACTORS, sig


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
        admission_ms=sig(s["admission_ms_median"]),
        admission_host_syncs=s["admission_host_syncs_median"],
        drain_step_ms=sig(s["drain"]["step_ms_median"]),
        drain_step_ms_max=sig(s["drain"]["step_ms_max"]),
        base_step_ms=sig(s["base"]["step_ms_median"]),
        drain_steps_to_recover=doc["drain_steps_to_recover"])


def _capacity(doc: dict) -> tuple[str, dict]:
    return "cpu", dict(kv_mb=round(doc["kv_cache_bytes"] / 1e6), prompt_tokens=doc["prompt_len"],
                       resident_running=doc["resident"]["max_running"],
                       connector_running=doc["connector"]["max_running"])


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
    """Per shape: the most sessions per byte of history against resident serving, with
    the history in vLLM's blocks and (where run) in ``history_block_tokens`` blocks."""
    out = {}
    for name, s in doc["shapes"].items():
        out[f"most_sessions_ratio_{name}"] = s["most_sessions_ratio"]
        if "most_sessions_ratio_wide" in s:
            out[f"most_sessions_ratio_wide{s['history_block_tokens']}_{name}"] = \
                s["most_sessions_ratio_wide"]
            out[f"stride_ratio_wide{s['history_block_tokens']}_{name}"] = s["stride_ratio_wide"]
    return "cpu", out


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


def _bench_gather(doc: dict) -> tuple[str, dict]:
    """``bench_gather.py``: the Triton row gather against one pinned ``copy_`` of as many
    bytes, over every row size, batch and miss count."""
    pts = doc["points"]
    ratios = [p["triton_over_memcpy"] for p in pts]
    return "gpu", dict(cases=len(pts), correct=sum(p["correct"] for p in pts),
                       pinned_copy_gbps=sig(doc["pinned_h2d"]["median_gbps"]),
                       triton_gbps_max=sig(max(p["triton"]["gbps"] for p in pts)),
                       triton_over_memcpy_min=sig(min(ratios)),
                       triton_over_memcpy_max=sig(max(ratios)))


def _bench_host_reads(doc: dict) -> tuple[str, dict]:
    """``bench_host_reads.py``: GB/s of scattered zero-copy reads, 512 rows per batch row at
    batch 8 and 32 (where the page kinds differ), by how the host pool was allocated."""
    out = dict(errors=sum(len(k["errors"]) for k in doc["kinds"]))
    for kind in doc["kinds"]:
        gbps = {(c["batch"], c["rows"]): c["gbps"] for c in kind["cells"]}
        for batch in (8, 32):
            out[f"{kind['kind']}_gbps_batch{batch}_rows512"] = sig(gbps[(batch, 512)])
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
        out.update(fit_over_pinned_min=sig(min(f["ratio_to_pinned"] for f in fits)),
                   fit_over_pinned_max=sig(max(f["ratio_to_pinned"] for f in fits)),
                   disjoint_over_shared_min=sig(min(f["disjoint_over_shared"] for f in fits)),
                   disjoint_over_shared_max=sig(max(f["disjoint_over_shared"] for f in fits)))
    if doc["nomiss_path"]:
        paths.append("nomiss")
        us = {(p["batch"], p["budget"], p["path"]): 1e3 * p["median_ms"]
              for p in doc["nomiss_path"] if p["misses_per_request"] == 0}
        out.update(direct_us_batch8_b4096=sig(us[(8, 4096, "direct")]),
                   scan_us_batch8_b4096=sig(us[(8, 4096, "scan")]),
                   direct_over_scan_min=sig(min(us[(b, B, "direct")] / t
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
        sglang_over_ours_min=sig(min(ratio.values())),
        sglang_over_ours_batch8_miss5=sig(ratio[(8, 5)]),
        sglang_over_ours_batch160_miss5=sig(ratio[(160, 5)]),
        correctness_failures=len(doc["correctness_failures"]))


def _cpu_step_parts(doc: dict) -> tuple[str, dict]:
    """``cpu_step_parts.py``: medians of a decode step's forward and of one c4a layer's
    attention call, resident against routed, and of the connector's resolve per call."""
    res, con = doc["arms"]["resident"], doc["arms"]["connector"]
    med = lambda arm, name: sig(arm[name]["median_ms"], 4)  # noqa: E731
    return "cpu", dict(
        forward_ms_resident=med(res, "GPUModelRunner.execute_model"),
        forward_ms_connector=med(con, "GPUModelRunner.execute_model"),
        c4a_layer_ms_resident=med(res, "upstream attention c4 T=1"),
        c4a_layer_ms_connector=med(con, "routed attention c4 T=1"),
        resolve_ms=med(con, "StepContext.resolve"))


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
        glm_resident_gib_100k=sig(glm["resident"], 4),
        glm_adaptive_gib_100k=sig(glm["adaptive"], 4),
        paper_adaptive_gib_100k=doc["paper_table1_gib"]["100000"]["adaptive"],
        v4_flash_resident_gib_500k=sig(v4["resident"], 4),
        v4_flash_adaptive_gib_500k=sig(v4["adaptive"], 4))


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
    out = {f"us_batch{b}_b{B}": sig(us[(b, B)], 4) for b in (8, 160) for B in (4096, 16384)}
    out["checked"] = all(p["ok"] for p in pts)
    return _overrides(pts[0]["variant"]).lstrip("_") or "defaults", out


EXTRACTORS = {"kv_layout": _kv_layout, "multi_turn": _multi_turn, "needle": _needle,
              "bench_hierarchy_step": _hierarchy_step, "capacity": _capacity,
              "bench_sessions": _bench_sessions, "cpu_server": _cpu_server,
              "bench_hierarchy_load": _hierarchy_load, "bench_gather": _bench_gather,
              "bench_host_reads": _bench_host_reads, "bench_resolve": _bench_resolve,
              "bench_sglang": _bench_sglang, "cpu_step_parts": _cpu_step_parts,
              "load_step": _load_step, "memory_accounting": _memory_accounting,
              "staging_memory": _staging_memory, "spec_memory": _spec_memory,
              "tune_chunks": _tune_chunks, **GPU_EXTRACTORS}
