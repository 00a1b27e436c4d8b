"""The results ledger (benchmarks/ledger.py): its records are complete, their numbers are
what the committed result files say, and README's results table is rendered from it."""
import json

import pytest

from benchmarks import ledger


def test_every_record_is_complete_and_names_committed_files():
    records = ledger.load()
    assert records, "the ledger is empty"
    for rec in records:
        assert rec["files"], rec
        missing = [f for f in rec["files"] if not (ledger.RESULTS / f).is_file()]
        assert missing == [], f"{rec['benchmark']} names files not in results/: {missing}"


def test_every_number_is_the_result_files_number():
    """A record's metrics are its extractor's reading of its files, not typed by hand."""
    for rec in ledger.load():
        if rec["benchmark"] in ledger.EXTRACTORS:
            assert ledger.record_from(rec["benchmark"], rec["files"]) == rec


def test_every_result_file_is_named_by_the_ledger():
    """results/ holds the ledger, the files its records name and archive/ (superseded runs);
    a file inside a run's folder of logs counts only where a record names it."""
    named = {f for rec in ledger.load() for f in rec["files"]}
    stray = sorted(f for f in (p.relative_to(ledger.RESULTS).as_posix()
                               for p in ledger.RESULTS.rglob("*") if p.is_file())
                   if f not in named and f != ledger.LEDGER.name and not f.startswith("archive/"))
    assert stray == [], (f"results/ holds files no ledger record names: {stray}; give the run "
                         "a record (python benchmarks/ledger.py --add BENCHMARK FILE...) or move "
                         "a superseded run to results/archive/")


def test_readme_results_table_is_the_ledgers():
    assert ledger.readme_table(ledger.README.read_text()) == ledger.render(ledger.load()), \
        "README.md's results table is not the ledger's: python benchmarks/ledger.py --readme"


def rec(benchmark, config, date, **metrics):
    return dict(benchmark=benchmark, config=config, commit="abc1234", date=date,
                machine="m", metrics=metrics, files=["f.json"])


def test_the_latest_record_of_each_benchmark_and_config_wins():
    old, new = rec("b", "c", "2026-12-01", x=1), rec("b", "c", "2026-12-03", x=2)
    other = rec("b", "d", "2026-12-02", x=3)
    assert ledger.latest([new, other, old]) == {("b", "c"): new, ("b", "d"): other}


def test_a_headline_without_a_record_and_a_record_without_a_key_are_errors(tmp_path):
    with pytest.raises(KeyError, match="no record of .*needle"):
        ledger.render([])
    bad = tmp_path / "ledger.jsonl"
    bad.write_text(json.dumps({"benchmark": "b", "config": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"ledger.jsonl:1: record lacks \['commit'"):
        ledger.load(bad)


def test_a_result_naming_no_commit_needs_the_commit_that_committed_it(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "RESULTS", tmp_path)
    monkeypatch.setitem(ledger.EXTRACTORS, "b", lambda doc: ("c", {"x": doc["x"]}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": {"date_utc": "2026-12-01T10:00:00Z"},
                                                 "x": 1}))
    with pytest.raises(ValueError, match="b.json names no commit"):
        ledger.record_from("b", ["b.json"])
    monkeypatch.setitem(ledger.COMMITTED_IN, "b.json", dict(commit="abc1234", machine="m"))
    assert ledger.record_from("b", ["b.json"]) == dict(
        benchmark="b", config="c", commit="abc1234", date="2026-12-01", machine="m",
        metrics={"x": 1}, files=["b.json"], commit_note=ledger.COMMIT_NOTE)


def test_check_fails_when_the_readme_drifts(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    text = ledger.README.read_text()
    readme.write_text(text.replace("382 of 382", "383 of 382"))
    monkeypatch.setattr(ledger, "README", readme)
    assert ledger.main(["--check"]) == 1
    assert ledger.main(["--readme"]) == 0 and ledger.main(["--check"]) == 0
