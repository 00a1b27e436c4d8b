"""A host prefix hit's loaded KV, byte for byte against the blocks vLLM computed (a scenario
of ``gpu_connector.py``: ``--scenarios host_prefix_bytes``, connector arm with
``host_prefix_gib``).

In one engine, one request at a time:

* ``x``: a prompt P, prefilled by vLLM; when it finishes the connector captures its prefix
  entry (KV up to the last 256-token boundary, N) into host memory;
* vLLM's prefix cache is reset, so the next request can only hit host;
* ``y``: P followed by new tokens; the connector loads N tokens of KV from host into y's
  blocks and vLLM prefills the rest;
* ``z``: P again with a cache salt: no hit of either kind, vLLM prefills all of it (vLLM
  against itself: the same prompt, batch and shapes as ``x``).

Then, every block position below N that a request resuming at N needs (all of them for
full-attention groups, the window at N for sliding-window groups), per KV layer: y's bytes
against x's (the loaded copy against vLLM's computation of those tokens) and x's against z's.
c4a layers are compared by rows (data and scales; a block's padding is no row), the other
layers by whole blocks.  Block ids are read from vLLM's scheduler right after each schedule (the first
id each position had: vLLM hands sliding-window blocks back and the device window c4a
blocks while a request runs), and each request's bytes are copied as soon as it has ended,
before the next request can be given its blocks.  vLLM hands an ended request's blocks to
the next (``y_blocks_x_held`` counts them): y given x's block at the same position would
equal x's whatever the load wrote, so the check fails unless there is none
(``y_blocks_where_x_had_them``).
"""
from __future__ import annotations

NULL_BLOCK = 0


def _drive(llm, rid: str, ids: list[int], max_tokens: int, salt: str | None) -> dict:
    """Serves one request alone; returns its first block id at every position per group."""
    from vllm import SamplingParams

    from harness.offline_run import in_process_scheduler
    engine, sched = llm.llm_engine, in_process_scheduler(llm)
    inputs = {"prompt_token_ids": ids}
    if salt is not None:
        inputs["cache_salt"] = salt
    engine.add_request(rid, inputs, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    seen: list[dict[int, int]] = []

    def record() -> None:
        # vLLM may suffix the id it was given
        inner = next((r for r in sched.requests if r.startswith(rid)), None)
        if inner is None:
            return
        groups = sched.kv_cache_manager.get_block_ids(inner)
        seen.extend({} for _ in range(len(groups) - len(seen)))
        for g, blocks in enumerate(groups):
            for p, b in enumerate(blocks):
                if b != NULL_BLOCK:
                    seen[g].setdefault(p, b)

    schedule = sched.schedule

    def recording(*a, **kw):
        # right after allocation: by the step's end vLLM (sliding windows) and the device
        # window (c4a) may have handed blocks back
        out = schedule(*a, **kw)
        record()
        return out
    patched = vars(sched).get("schedule")  # an instance patch of the caller's, kept
    sched.schedule = recording
    cached = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    cached = out.num_cached_tokens
    finally:
        if patched is None:
            del sched.schedule
        else:
            sched.schedule = patched
    engine.step()  # tells the worker the request finished: its capture
    return dict(blocks=seen, num_cached_tokens=cached)


def _c4a_blocks(layer, n: int) -> range:
    """Block positions of a c4a layer's first ``n // ratio`` rows."""
    return range(-(-(n // layer.compress_ratio) // layer.rows_per_block))


def _compared_positions(store, n: int) -> set[tuple[int, int]]:
    """(group, block position) pairs whose bytes are compared (see :func:`_contents`)."""
    from vllm_dhisparse.integration.host_prefix.index import window_positions
    out = set()
    for name in store.layout.caches:
        g = store.layout.group[name]
        out |= {(g, p) for p in window_positions(store.spec[name], n)}
    for layer in store.c4a.values():
        out |= {(layer.group, p) for p in _c4a_blocks(layer, n)}
    return out


def _contents(w, store, r: dict, n: int) -> dict:
    """Copies of what a request resuming at ``n`` tokens needs of request ``r``'s blocks:
    per non-c4a layer its blocks at the positions vLLM keeps (bytes), per c4a layer its
    first ``n // ratio`` rows; None where a position had no block, or one block served two
    positions (a block the request handed back and got again: its bytes are the later
    position's)."""
    import torch

    from vllm_dhisparse.integration.host_prefix.index import window_positions
    ids = {b for g in r["blocks"] for b in g.values()}
    reused = sum(len(g) for g in r["blocks"]) != len(ids)
    out = {}
    for name, cache in store.layout.caches.items():
        g = r["blocks"][store.layout.group[name]]
        out[name] = [None if p not in g or reused else
                     cache[g[p]].contiguous().view(torch.uint8).clone()
                     for p in window_positions(store.spec[name], n)]
    for name, layer in store.c4a.items():
        g = r["blocks"][layer.group]
        rows = n // layer.compress_ratio
        positions = _c4a_blocks(layer, n)
        ok = not reused and all(p in g for p in positions)
        out[name] = w.vllm_cache.first_rows(layer, [g[p] for p in positions], rows).clone() \
            if ok else None  # [rows, row_bytes] uint8
    return out


def check(llm, scale: float, prompt) -> dict:
    """The scenario; ``prompt(length, seed)`` makes token ids."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from harness.offline_run import reset_prefix_cache
    w = get_kv_transfer_group().dhisparse_worker if has_kv_transfer_group() else None
    store = None if w is None else w.host_prefix
    if store is None:
        return dict(skipped="no host prefix store (host_prefix_gib 0, or resident serving)")
    first = prompt(int(3000 * scale), 90)
    n = len(first) // store.boundary * store.boundary  # x's entry
    # each request's bytes are copied before the next one runs: vLLM hands the blocks of an
    # ended request to the next (uncached ones first)
    x = _drive(llm, "hpb-x", first, 1, None)
    got = {"x": _contents(w, store, x, n)}
    if reset_prefix_cache(llm, tries=4) is None:
        raise RuntimeError("reset_prefix_cache refused: blocks still held")
    y = _drive(llm, "hpb-y", first + prompt(200, 91), 1, None)
    got["y"] = _contents(w, store, y, n)
    z = _drive(llm, "hpb-z", first, 1, "hpb-z")
    got["z"] = _contents(w, store, z, n)
    res = dict(prompt_tokens=len(first), entry_tokens=n, loaded_tokens=y["num_cached_tokens"],
               cached_x=x["num_cached_tokens"], cached_z=z["num_cached_tokens"],
               host_prefix=w.summary().get("host_prefix"))
    # per request and group: the block positions seen (first, last, count)
    res["held"] = {k: [[min(g), max(g), len(g)] if g else [] for g in r["blocks"]]
                   for k, r in (("x", x), ("y", y), ("z", z))}
    kinds: dict[str, dict[str, int]] = {}
    for name in got["x"]:
        kind = "c4a" if name in store.c4a else "sliding" if name in store.sliding else "full"
        t = kinds.setdefault(kind, dict(units=0, y_eq_x=0, x_eq_z=0, missing=0))
        if kind == "c4a":
            gx, gy, gz = (got[k][name] for k in "xyz")
            if gx is None or gy is None or gz is None:
                t["missing"] += 1
                continue
            t["units"] += gx.shape[0]
            t["y_eq_x"] += int((gy == gx).all(1).sum())
            t["x_eq_z"] += int((gx == gz).all(1).sum())
            continue
        for bx, by, bz in zip(*(got[k][name] for k in "xyz")):
            if bx is None or by is None or bz is None:
                t["missing"] += 1
                continue
            t["units"] += 1
            t["y_eq_x"] += int(torch.equal(by, bx))
            t["x_eq_z"] += int(torch.equal(bx, bz))
    res["compared"] = kinds  # units: blocks (full, sliding) or rows (c4a)
    # y given x's block at the same position would hold x's bytes whatever the load wrote
    # (at another position it holds another token's bytes, which a load that wrote nothing
    # leaves unequal)
    def at(r: dict, g: int, p: int) -> int | None:
        return r["blocks"][g].get(p) if g < len(r["blocks"]) else None
    pairs = _compared_positions(store, n)
    res["y_blocks_where_x_had_them"] = sum(
        at(y, g, p) is not None and at(y, g, p) == at(x, g, p) for g, p in pairs)
    x_ids = {b for g in x["blocks"] for b in g.values()}
    res["y_blocks_x_held"] = sum(at(y, g, p) in x_ids for g, p in pairs)
    res["loaded_equal_computed"] = (
        res["loaded_tokens"] == n and bool(kinds) and res["y_blocks_where_x_had_them"] == 0
        and all(k["y_eq_x"] == k["units"] > 0 and k["missing"] == 0 for k in kinds.values()))
    return res
