"""Prefill on one engine, decode on another, through the connector's handoff.

A ``kv_producer`` engine (its own process, kept alive to serve pulls) prefills
each prompt with ``do_remote_decode`` and ``max_tokens=1``, as Ray Serve LLM's
PDDecodeServer and vLLM's toy proxy do; a ``kv_consumer`` engine gets each
prompt with the producer's ``kv_transfer_params``, pulls the KV (c4a history
into its hierarchy, every other group into vLLM's blocks) and decodes.  The
oracle is single-instance resident serving (connector off).

vLLM recomputes the last prompt token of a fully loaded prompt to sample the
first output token; in resident serving that token is part of the prompt's
prefill forward, so the first logprob can round differently (the CPU GEMMs
see another row count).  ``test_first_token_matches_resident_last_token_alone``
shows that this is the whole difference: when resident serving and the producer
both prefill all but the last prompt token in one step (chunked prefill of
L - 1), every row is computed with the same shapes in both, and P/D equals
resident bit for bit on any CPU, whether or not its GEMMs round a row the same
way at another row count.
"""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests import isa
from vllm_dhisparse.demo import free_port, wait_healthy

from .conftest import REPO, assert_same_outputs, run_offline
from .readme_block import (completions_in, metric, post_json, readme_pd_block, run_block,
                           stop_group, wait_for_block)

pytestmark = pytest.mark.e2e

LENS = [600, 1500, 3000]
MAX_TOKENS = [8, 5, 6]
DECODE = {"hot_cache_rows": 512, "optional_residency": False}  # small hot cache: host fetches
# both arms alike: one engine core in the process, one reserved CPU core (vLLM reserves one
# more for a KV connector, and another thread count rounds differently)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
SETS = "ABC"


def args(lens=LENS, max_tokens=MAX_TOKENS):
    return ["--prompt-lens", *map(str, lens), "--max-tokens", *map(str, max_tokens)]


class Producer:
    """A kv_producer engine that prefilled ``lens`` once per handoff set (A, B, C: one
    per test that pulls, so no test depends on another having run) and serves pulls
    until ``stop``."""

    def __init__(self, model, tmp, lens=LENS, sets=SETS, extra=(), env=ENV):
        self.stop_file = str(tmp / "stop")
        # port 0: the worker binds a free port and reports it through vLLM's handshake
        cfg = {"handoff_port": 0, "handoff_host": "127.0.0.1", "handoff_lease_s": 600}
        cmd = [sys.executable, "-m", "harness.offline_run", "--model", model,
               *args(lens, [1] * len(lens)), "--repeat", str(len(sets)), *extra,
               "--kv-role", "kv_producer", "--remote-decode", "--hold-until", self.stop_file,
               "--connector", json.dumps(cfg)]
        self.log = open(tmp / "producer.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **env}, cwd=REPO)
        line = ""
        while not line.startswith("DHISPARSE_RESULT "):
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"producer exited rc={self.proc.returncode}\n"
                                     f"{self.log.read()[-6000:]}")
        self.result = json.loads(line.split(" ", 1)[1])
        params = [o["kv_transfer_params"] for o in self.result["outputs"]]
        n = len(lens)
        self.sets = {name: params[k * n:(k + 1) * n] for k, name in enumerate(sets)}

    def held_summary(self) -> dict:
        """Stops the producer; its connector counters after every pull."""
        open(self.stop_file, "w").close()
        out, _ = self.proc.communicate(timeout=120)
        for line in out.splitlines():
            if line.startswith("DHISPARSE_HELD "):
                return json.loads(line.split(" ", 1)[1])
        raise AssertionError(f"producer printed no DHISPARSE_HELD line:\n{out[-3000:]}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def producer(demo_model, tmp_path_factory):
    p = Producer(demo_model, tmp_path_factory.mktemp("pd"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def resident(demo_model):
    return run_offline(demo_model, *args(), env=ENV)


def decode(model, tmp_path, params, *extra, lens=LENS, max_tokens=MAX_TOKENS, cfg=None,
           env=ENV):
    path = tmp_path / "params.json"
    path.write_text(json.dumps({"outputs": [{"kv_transfer_params": p} for p in params]}))
    # --settle-loads: the loads of one step are reported together, so the requests decode
    # in one batch from their first step as in resident serving (the CPU GEMMs round by
    # row count); otherwise which step a load ends in is up to transfer timing
    return run_offline(model, *args(lens, max_tokens), "--kv-role", "kv_consumer",
                       "--kv-params", str(path), "--settle-loads",
                       "--connector", json.dumps({**DECODE, **(cfg or {})}), *extra, env=env)


def assert_pd_outputs(got, want, requests=None):
    """Tokens identical; logprobs identical after the first token (its logprob comes from
    the recomputed last prompt token, see the module doc)."""
    for i in requests if requests is not None else range(len(want["outputs"])):
        g, w = got["outputs"][i], want["outputs"][i]
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: tokens differ from resident"
        assert g["logprobs"][1:] == w["logprobs"][1:], f"prompt {i}: logprobs differ"
        assert abs(g["logprobs"][0] - w["logprobs"][0]) < 1e-4, f"prompt {i}: first logprob"


def test_decode_from_handoff_matches_resident(demo_model, producer, resident, tmp_path):
    got = decode(demo_model, tmp_path, producer.sets["A"])
    # the same batches as resident serving once the loads have landed (steps before that
    # run nothing), the precondition of bitwise logprobs
    busy = [[n for n in run["running"] if n] for run in (got, resident)]
    assert busy[0] == busy[1], (got["running"], resident["running"])
    assert_pd_outputs(got, resident)
    t, h = got["stats"]["totals"], got["stats"]["handoff"]
    # the decode engine ran one prompt token per request (the last, to sample), not the prompt
    assert t["prompt_tokens_computed"] == len(LENS), t
    assert h["received"] == len(LENS) and h["failed"] == 0, h
    assert h["tokens_loaded"] == sum(LENS) and h["bytes_received"] > 0, h
    # c4a history went into the hierarchy: with optional residency off, straight to host,
    # and decoding read it from there
    assert h["rows_host"] > 0 and h["rows_host"] + h["rows_device"] == 2 * sum(LENS) // 4, h
    assert t["host"] > 0 and t["fetched"] > 0, t
    assert t["admissions"] == len(LENS)
    # vLLM's own prompt-token sources and the handoff metrics (its Prometheus path) agree
    m = got["pd_metrics"]
    assert m["vllm:prompt_tokens_by_source|local_compute"] <= len(LENS), m
    assert m["vllm:prompt_tokens_by_source|external_kv_transfer"] >= sum(LENS) - len(LENS), m
    assert m["vllm:dhisparse_handoffs_received"] == len(LENS), m
    assert m["vllm:dhisparse_handoff_bytes_received"] == h["bytes_received"], m
    assert m["vllm:dhisparse_handoff_seconds"] == len(LENS), m  # one load-time sample each


@pytest.mark.parametrize("level", [isa.session_level(), *isa.others()])
def test_first_token_matches_resident_last_token_alone(demo_model, tmp_path, level):
    """P/D equals resident serving bit for bit, first logprob included, once both compute
    the same rows with the same shapes: resident and the producer prefill L - 1 tokens in one
    step (chunked prefill), and resident computes the last prompt token in a step of its own
    as the consumer does.  At each ISA level this CPU can run (tests/isa.py): the GEMMs of
    another level round another way, the same in all three engines."""
    n = LENS[0]
    split = ("--chunk-tokens", str(n - 1))
    env = {**ENV, **isa.env(level)}
    want = run_offline(demo_model, *args([n], [8]), *split, env=env)
    producer = Producer(demo_model, tmp_path, lens=[n], sets="A", extra=split, env=env)
    try:
        got = decode(demo_model, tmp_path, producer.sets["A"], lens=[n], max_tokens=[8],
                     env=env)
    finally:
        producer.close()
    assert got["stats"]["totals"]["prompt_tokens_computed"] == 1
    assert_same_outputs(got, want)


def test_without_params_decode_computes_the_prompt(demo_model, resident):
    """Negative control: the same consumer without kv_transfer_params prefills itself."""
    got = run_offline(demo_model, *args(), "--kv-role", "kv_consumer",
                      "--connector", json.dumps(DECODE), env=ENV)
    assert_same_outputs(got, resident)
    assert got["stats"]["totals"]["prompt_tokens_computed"] == sum(LENS)
    assert got["stats"]["handoff"]["received"] == 0
    assert got["pd_metrics"]["vllm:prompt_tokens_by_source|local_compute"] == sum(LENS)


def test_failed_handoff_fails_that_request_alone(demo_model, producer, resident, tmp_path):
    """Policy fail: a handoff already pulled errors its request; the others load.  The
    test pulls set C's first handoff itself (as a decode instance that loaded it would),
    so the consumer finds it gone whichever tests ran before."""
    from vllm_dhisparse.integration.handoff.transport import pull
    params = producer.sets["C"]
    first = params[0]
    taken, _ = pull(first["remote_host"], first["remote_port"],
                    first["dhisparse"]["handoff_id"], timeout_s=30)
    assert taken.num_tokens == LENS[0]
    got = decode(demo_model, tmp_path, params)
    assert got["outputs"][0]["finish_reason"] == "error", got["outputs"][0]
    assert_pd_outputs(got, resident, requests=[1, 2])
    h = got["stats"]["handoff"]
    assert (h["received"], h["failed"]) == (2, 1), h


def test_failed_handoff_recomputes(demo_model, producer, resident, tmp_path):
    """Policy recompute: an unknown handoff id and a producer that is gone (nothing
    listens there) are computed locally; the valid handoff still loads.  Tokens only:
    the recomputed prefills share their forward with the loaded request's one-token
    step, which resident serving never runs, and bf16 sums round differently there."""
    bad_id, gone, good = (dict(p) for p in producer.sets["B"])
    bad_id["dhisparse"] = {**bad_id["dhisparse"], "handoff_id": "no-such-handoff"}
    gone["remote_port"] = free_port()
    got = decode(demo_model, tmp_path, [bad_id, gone, good], "--load-failure-policy",
                 "recompute", cfg={"handoff_timeout_s": 2.0})
    assert_same_outputs(got, resident, logprobs=False)
    assert got["stats"]["totals"]["prompt_tokens_computed"] == LENS[0] + LENS[1] + 1
    h = got["stats"]["handoff"]
    assert (h["received"], h["failed"]) == (1, 2), h

    # every capture is pulled once, held or expired; B's first two were never pulled
    # (their lease, 600 s, outlives the test)
    held = producer.held_summary()["handoff"]
    assert held["captured"] == len(SETS) * len(LENS), held
    assert held["captured"] == held["sent"] + held["held"] + held["expired"], held
    assert held["held"] >= 2 and held["sent"] >= 1 and held["expired"] == 0, held


def test_readme_two_servers(demo_model, tmp_path):
    """The documented P/D block (docs/pd_handoff.md, README's pointer), run by bash as
    written (the demo model for MODEL, free ports
    for 8100 / 8200 / 5790): its last request answers.  Then a prompt through the same two
    servers, as the block's router steps do it, against a resident server (connector off)
    with the decode server's settings: tokens equal, logprobs after the first (module
    doc), and the decode server loaded the prompt instead of computing it (its /metrics).
    The oracle is a server, not the offline engine the other tests run (eager, chunked
    prefill and prefix caching forced on): on an AVX2 CPU (an AMD EPYC) a resident server's
    logprobs differed from that engine's by up to 1.4e-4, and the two P/D servers' equalled
    the resident server's."""
    ports = {p: str(free_port()) for p in ("8100", "8200", "5790")}
    block = readme_pd_block().replace("MODEL", demo_model)
    for old, new in ports.items():
        block = block.replace(old, new)
    log = tmp_path / "readme_pd.log"
    bin_dir = os.path.dirname(sys.executable)  # the venv's vllm-dhisparse
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"],
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # resident serving's thread count
    shell = run_block(block, log, env, tmp_path)
    resident_port = free_port()
    resident_url = f"http://127.0.0.1:{resident_port}"
    resident = run_block(
        f"exec {sys.executable} -m vllm.entrypoints.openai.api_server --model {demo_model} "
        f"--host 127.0.0.1 --port {resident_port} --kv-cache-memory-bytes 1G "
        f"--no-enable-prefix-caching", tmp_path / "resident.log", env, tmp_path)
    try:
        wait_for_block(shell, log)
        text = log.read_text()
        answers = completions_in(text)
        assert shell.returncode == 0 and answers and answers[-1]["choices"][0]["text"], \
            f"rc={shell.returncode}\n{text[-6000:]}"
        prefill, decode_url = (f"http://127.0.0.1:{ports[p]}" for p in ("8100", "8200"))
        from harness.offline_run import prompt_ids
        req = dict(model=demo_model, prompt=prompt_ids(LENS[0], 0), temperature=0.0)
        first = post_json(prefill + "/v1/completions", {
            **req, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        got = post_json(decode_url + "/v1/completions", {
            **req, "max_tokens": MAX_TOKENS[0], "logprobs": 1, "return_token_ids": True,
            "kv_transfer_params": first["kv_transfer_params"]})["choices"][0]
        wait_healthy(resident_url, resident, 900)
        want = post_json(resident_url + "/v1/completions", {
            **req, "max_tokens": MAX_TOKENS[0], "logprobs": 1,
            "return_token_ids": True})["choices"][0]
        assert got["token_ids"] == want["token_ids"], (got["token_ids"], want["token_ids"])
        lp, want_lp = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
        assert lp[1:] == pytest.approx(want_lp[1:], abs=1e-6)
        assert abs(lp[0] - want_lp[0]) < 1e-3
        with urllib.request.urlopen(decode_url + "/metrics", timeout=30) as r:
            m = r.read().decode()
        # two requests (README's and this one), each loaded; at most the last prompt token
        # of each computed (computing the prompt would count LENS[0] here)
        assert metric(m, "vllm:dhisparse_handoffs_received") == 2, m[-3000:]
        assert metric(m, "vllm:prompt_tokens_by_source", "local_compute") <= 2
        assert metric(m, "vllm:prompt_tokens_by_source", "external_kv_transfer") >= LENS[0] - 1
    finally:
        stop_group(shell.pid)
        stop_group(resident.pid)
