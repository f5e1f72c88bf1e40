"""`benchmarks/run_all.py` and the modules that write its pages
(`verdicts.py`, `results_page.py`, `speed_table.py`): the runner in one
process, verdicts over processes, the report, the speed table in the docs.

Uses tiny stand-in benchmark scripts (plain Python, no TensorFlow) in a
temporary folder, so nothing here times anything."""

import importlib.util
import json
import os
import sys
import types

import pytest

pytestmark = pytest.mark.tensorflow_only(reason="benchmarks/run_all.py runs the TensorFlow step")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"{name}_under_test", os.path.join(BENCHMARKS, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run_all(tmp_path, monkeypatch):
    module = load("run_all")
    monkeypatch.setattr(module, "HERE", str(tmp_path))
    monkeypatch.setattr(module, "OUT", str(tmp_path / "out"))
    monkeypatch.setattr(module, "DOCS_ROOT", str(tmp_path / "site"))
    return module


@pytest.fixture
def page(monkeypatch):
    """The three modules that write the pages, as one namespace."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import results_page
    import speed_table
    import verdicts

    return types.SimpleNamespace(**{**vars(verdicts), **vars(speed_table), **vars(results_page)})


# A stand-in benchmark: `main(argv)`, writes one JSON as `harness.report`
# does. Its figure is MEDIANS[i] in the i-th process that runs it (a counter
# file beside it), so that processes can disagree.
GOOD = '''"""Stand-in: two ratios. --quick"""
import json, os

HERE = os.path.dirname(os.path.abspath(__file__))
MEDIANS = {medians}


def main(argv=None):
    counter = os.path.join(HERE, "{name}.count")
    count = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(count + 1))
    median = MEDIANS[count % len(MEDIANS)] if "--quick" in argv else 9.0
    results = {{
        "a / b": {{"median": median, "min": 0.8, "max": 1.1, "rounds": 5,
                  "step_p25": 0.95, "best": 0.97}},
        "T=2: c / d": {{"median": 1.5, "min": 1.4, "max": 1.6, "rounds": 5,
                       "step_p25": 1.5, "best": 1.45}},
        "ops: e / f": {{"median": 1.2, "min": 1.2, "max": 1.2, "rounds": 1,
                       "kind": "op count (not a time)"}},
        "g / h": {{"median": 1.04, "min": 1.0, "max": 1.1, "rounds": 5, "step_p25": 1.0,
                  "best": 1.0}},
    }}
    targets = {{"a / b": "<= 1.00", "T=2: c / d": "<= 1.05 at T=4", "ops: e / f": "<= 1.5"}}
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "{name}.json"), "w") as f:
        json.dump({{"machine": "test machine", "results": results, "targets": targets,
                   "best_ms": {{"a": 1.0}}}}, f)
'''


def good(name, medians=(0.9,)):
    return GOOD.format(name=name, medians=list(medians))


def write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return str(path)


def test_runs_every_script_in_this_process_and_records_failures(tmp_path, run_all):
    write(tmp_path, "bench_good.py", good("good"))
    write(tmp_path, "bench_noquick.py", '"""No quick mode."""\ndef main(argv=None):\n    pass\n')
    write(tmp_path, "bench_broken.py", '"""--quick"""\ndef main(argv=None):\n    1 / 0\n')
    write(
        tmp_path, "bench_exits.py", '"""--quick"""\ndef main(argv=None):\n    raise SystemExit(2)\n'
    )
    write(
        tmp_path,
        "bench_silent.py",
        '"""Writes nothing. --quick"""\ndef main(argv=None):\n    pass\n',
    )
    write(
        tmp_path,
        "bench_slow.py",
        '"""--quick"""\nimport time\ndef main(argv=None):\n    time.sleep(30)\n',
    )
    write(tmp_path, "bench_models.py", '"""Builders only: no main."""\nraise SystemExit(5)\n')
    own = '"""Own process. --quick"""\nimport os, sys\nOWN_PROCESS = True\n'
    own += "def main(argv=None):\n    print('child', os.getpid())\n    raise SystemExit(4)\n"
    own += "if __name__ == '__main__':\n    main()\n"
    write(tmp_path, "bench_own.py", own)
    scripts = run_all.discover()
    assert [run_all.name_of(s) for s in scripts] == [
        "broken", "exits", "good", "noquick", "own", "silent", "slow",
    ]  # fmt: skip
    records = {r["name"]: r for r in run_all.run_set(scripts, True, 1.0)}
    good_record = records["good"]
    assert good_record["status"] == "ok" and good_record["title"] == "Stand-in: two ratios. --quick"
    assert good_record["outputs"]["good.json"]["results"]["a / b"]["median"] == 0.9  # --quick
    assert records["noquick"]["status"].startswith("not run: the script has no `--quick`")
    assert records["broken"]["status"].startswith("failed: ")
    assert "ZeroDivisionError" in records["broken"]["status"]
    assert records["exits"]["status"].startswith("failed (exit 2)")
    assert records["silent"]["status"] == "ran, but wrote no JSON to benchmarks/out/"
    assert records["slow"]["status"] == "timed out after 1 s"
    # OWN_PROCESS: another process ran it (its pid is not ours).
    assert records["own"]["own_process"] and records["own"]["status"].startswith("failed (exit 4)")
    assert f"child {os.getpid()}" not in records["own"]["status"]
    assert "child" in records["own"]["status"]


# (name, target, one figure per process, verdict over the processes)
VERDICT_CASES = [
    ("x", "<= 1.03", [1.01, 1.02, 1.00], "met"),
    ("x", "<= 1.03", [1.05, 1.06, 1.04], "not met"),
    ("x", "<= 1.03", [1.02, 1.04, 1.01], "noisy"),
    ("x", "<= 1.03", [1.04], "not met"),
    ("x", "< 1 to switch", [0.99, 0.98, 0.97], "met"),
    ("x", ">= 2", [2.5, 1.9, 2.1], "noisy"),
    ("T=4: PCGrad / floor", "<= 1.05 at T=4", [1.2, 1.3, 1.25], "not met"),
    ("T=2: PCGrad / floor", "<= 1.05 at T=4", [1.2, 1.3, 1.25], ""),
    ("x", "about 2 at T=4 (issue)", [2.0, 2.0, 2.0], ""),
    ("x", "lower is better", [0.5, 0.6, 0.4], ""),
    ("x", "", [0.5], ""),
]


@pytest.mark.parametrize("name, target, figures, expected", VERDICT_CASES)
def test_a_target_row_is_judged_over_processes(page, name, target, figures, expected):
    runs = [
        [
            {
                "name": "s",
                "outputs": {
                    "s.json": {
                        "results": {name: {"median": f, "step_p25": 1.0}},
                        "targets": {name: target},
                    }
                },
            }
        ]
        for f in figures
    ]
    (row,) = page.rows(runs).values()
    assert row["verdict"] == expected
    assert row["figures"] == figures


def test_results_md_holds_the_verdicts_and_each_process_figure(page):
    def process(median):
        stats = {"median": median, "min": 0.9, "max": 1.2, "rounds": 8, "step_p25": 1.0}
        stats["best"] = 0.99
        ops = {"median": 1.1, "min": 1.1, "max": 1.1, "rounds": 1, "kind": "op count"}
        out = {
            "results": {"m: fast / keras": stats, "ops: fast / keras": ops},
            "targets": {"m: fast / keras": "<= 1.03", "ops: fast / keras": "<= 1.2"},
        }
        record = {"name": "targets", "title": "T", "status": "ok", "wall_s": 12.0}
        return [{**record, "outputs": {"targets.json": out}}]

    runs = [process(1.02), process(1.04), process(1.01)]
    text = page.markdown(
        runs, "python benchmarks/run_all.py --processes 3", [100.0, 110.0, 105.0], False,
        "test machine", "git abc1234", (1.0, 2.0), 300,
    )  # fmt: skip
    assert "- Command: `python benchmarks/run_all.py --processes 3`" in text
    assert "- Code: git abc1234" in text and "test machine" in text
    assert (
        "- Processes: 3, one after another" in text
        and "- Statistic: the ratio of the two sides' median step" in text
    )
    summary = text.split("## Speed targets")[1].split("## Other targets")[0]
    assert "| targets: m: fast / keras | <= 1.03 | 1.020 / 1.040 / 1.010 | 1.000 / 1.000 / " in (
        summary
    )
    assert summary.rstrip().endswith("| noisy |")
    assert "ops: fast / keras" not in summary  # not a time: its own table, labelled
    others = text.split("## Other targets (not step time)")[1].split("## Speed table")[0]
    assert "| targets: ops: fast / keras | op count | <= 1.2 | 1.100 / 1.100 / 1.100 | met |" in (
        others
    )
    table = page.between_markers(text)
    assert "| pair | target | m |\n|---|---|---:|\n" in table  # a column per model
    assert "| fast / keras | <= 1.03 | 1.02 (1.01-1.04) noisy |\n" in table
    assert "ops" not in table  # step time only
    assert "3 processes" in table and "test machine" in table


def test_sync_docs_copies_the_table_between_the_markers(tmp_path, page):
    (tmp_path / "docs").mkdir()
    index = "# R\n\n## Speed\n\n<!-- speed-table:start -->\nold\n<!-- speed-table:end -->\n\nrest\n"
    (tmp_path / "docs" / "index.md").write_text(index)
    (tmp_path / "README.md").write_text(index)  # the README shows its short table instead
    assert page.sync_docs("| a | b |\n", root=str(tmp_path)) == [os.path.join("docs", "index.md")]
    assert (tmp_path / "docs" / "index.md").read_text() == index.replace("\nold\n", "\n| a | b |\n")
    assert (tmp_path / "README.md").read_text() == index
    assert page.sync_docs("| a | b |\n", root=str(tmp_path)) == []  # already equal


def test_the_docs_show_the_latest_run(page):
    """No page claims a number the latest run does not show: the speed
    tables of README.md and docs/index.md are RESULTS.md's (and those of
    every other page `run_all.py --page` wrote, where the docs show one)."""
    with open(os.path.join(BENCHMARKS, "RESULTS.md")) as f:
        assert page.between_markers(f.read()) is not None, (
            "benchmarks/RESULTS.md has no speed table: run run_all.py"
        )
    for results in page.pages_with_tables():
        with open(os.path.join(BENCHMARKS, f"{results}.md")) as f:
            latest = page.between_markers(f.read(), results)
        for doc in page.DOCS:
            with open(os.path.join(ROOT, doc)) as f:
                shown = page.between_markers(f.read(), results)
            if results == "RESULTS" or shown is not None:
                assert shown == latest, f"{doc}: run `python benchmarks/run_all.py --sync-docs`"


def test_a_named_page_has_its_own_markers_and_leaves_the_others(page, tmp_path):
    index = "a\n<!-- speed-table:start -->\nquick\n<!-- speed-table:end -->\n"
    index += (
        "<!-- speed-table-RESULTS-large:start -->\nold\n<!-- speed-table-RESULTS-large:end -->\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(index)
    assert page.sync_docs("| big |\n", root=str(tmp_path), page="RESULTS-large") == [
        os.path.join("docs", "index.md")
    ]
    text = (tmp_path / "docs" / "index.md").read_text()
    assert page.between_markers(text) == "quick"
    assert page.between_markers(text, "RESULTS-large") == "| big |"


def test_the_readme_shows_the_short_table_of_the_latest_runs(page):
    """The README's speed table (six rows in plain words, TensorFlow and
    JAX) is made from the latest results pages, as `run_all.py` writes it:
    no figure there that RESULTS.md, RESULTS-large.md or RESULTS-jax.md
    does not show."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start, end = page.SUMMARY_MARKERS
    assert start in text and end in text, f"README.md has no {start} ... {end}"
    shown = text.split(start, 1)[1].split(end, 1)[0].strip("\n")
    assert shown == page.summary_table(BENCHMARKS).strip("\n"), (
        "README.md's speed table: run `python benchmarks/run_all.py --sync-docs`"
    )
    rows = [line for line in shown.splitlines() if line.startswith("| ")][1:]
    assert 4 <= len(rows) <= 6, "the README's table stays short: docs/benchmarks.md has every row"
    for word in ("gated", "A/A", "noisy"):
        assert word not in shown, f"{word!r}: a word the README's reader does not know"


def test_the_short_table_reads_each_page_and_says_what_it_could_not(page, tmp_path):
    rows = (
        "| MLP 64-3x256-10: default / keras.Model gated on finite gradients | step time "
        "| 1.10 / 0.90 / 1.00 | x |\n"
        "| JAX MLP 64-3x256-10: clip_norm=1 / global_clipnorm=1 | step time | 1.20 | x |\n"
    )
    (tmp_path / "RESULTS.md").write_text("- Date: 2026-01-02 03:04 UTC\n- Processes: 3\n" + rows)
    (tmp_path / "RESULTS-jax.md").write_text(rows)
    table = page.summary_table(str(tmp_path))
    lines = table.splitlines()
    # the median over processes, their range; a page not there: not measured
    assert lines[2].split(" | ")[2:4] == ["1.00 (0.90-1.10)", "not measured"]
    assert lines[4].split(" | ")[4].startswith("1.20*")  # the stand-in pair, marked
    assert "From benchmarks/RESULTS.md (2026-01-02, 3 processes)." in table
    site = tmp_path / "site"
    site.mkdir()
    start, end = page.SUMMARY_MARKERS
    (site / "README.md").write_text(f"a\n{start}\nold\n{end}\nb\n")
    assert page.sync_summary(str(tmp_path), root=str(site)) == ["README.md"]
    assert (site / "README.md").read_text() == f"a\n{start}\n{table.strip()}\n{end}\nb\n"
    assert page.sync_summary(str(tmp_path), root=str(site)) == []  # already equal


@pytest.mark.slow  # two fresh processes
def test_main_runs_n_processes_and_writes_the_pages(tmp_path, run_all, capsys):
    write(tmp_path, "bench_targets.py", good("targets", medians=(0.9, 1.1)))
    write(tmp_path, "bench_other.py", good("other"))
    site = tmp_path / "site"
    (site / "docs").mkdir(parents=True)
    marked = "x\n<!-- speed-table:start -->\nold\n<!-- speed-table:end -->\n"
    (site / "README.md").write_text(marked)
    (site / "docs" / "index.md").write_text(marked)
    assert run_all.main(["--quick", "--processes", "2"]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "- Command: `python benchmarks/run_all.py --quick --processes 2`" in text
    assert "- Processes: 2" in text
    # The processes disagree on targets' `a / b` (0.9, then 1.1): noisy.
    assert (
        "| targets: a / b | <= 1.00 | 0.900 / 1.100 | 0.950 / 0.950 | 0.970 / 0.970 | noisy |"
        in (text)
    )
    assert "| other: a / b | <= 1.00 | 0.900 / 0.900 |" in text and "| met |" in text
    table = (tmp_path / "out" / "speed_table.md").read_text()
    assert "| pair | target | figure | T=2 |" in table
    assert "| a / b | <= 1.00 | 1.00 (0.90-1.10) noisy | - |" in table
    assert "| g / h | reported | 1.04 (1.04-1.04) | - |" in table
    assert "| c / d | <= 1.05 at T=4 | - | 1.50 (1.50-1.50) |" in table
    assert "other" not in table.split("\n\n")[0]  # bench_targets' rows only
    assert (site / "docs" / "index.md").read_text() == marked.replace("old\n", table)
    assert (site / "README.md").read_text() == marked  # its short table has its own markers
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "out" / "process_2.json").read_text())[0]["name"] == "other"
    assert "process 2 of 2" in capsys.readouterr().out
    (tmp_path / "RESULTS.md").write_text("stale")
    assert run_all.main(["--render"]) == 0  # the pages again, from out/run.json
    assert (tmp_path / "RESULTS.md").read_text() == text


def test_processes_must_be_at_least_one(run_all):
    with pytest.raises(SystemExit):
        run_all.main(["--processes", "0"])


def test_the_speed_table_has_a_line_per_pair_and_a_column_per_model(page):
    def stats(median):
        return {"median": median, "step_p25": 1.0}

    out = {
        "results": {
            "MLP: default / keras.Model": stats(1.01),
            "CNN: default / keras.Model": stats(1.05),
            "MLP: agc / default": stats(1.05),
            "CNN: agc / default": stats(1.02),
            "Embedding: agc / default": stats(1.01),
        },
        "targets": {
            "MLP: default / keras.Model": "<= 1.03",
            "CNN: default / keras.Model": "<= 1.03",
            "MLP: agc / default": "<= 1.06",
            "CNN: agc / default": "<= 1.03",
            "Embedding: agc / default": "<= 1.03",
        },
    }
    runs = [[{"name": "targets", "outputs": {"targets.json": out}}]]
    assert page.speed_table(runs, "Measured here.") == (
        "| pair | target | MLP | CNN | Embedding |\n"
        "|---|---|---:|---:|---:|\n"
        "| default / keras.Model | <= 1.03 | 1.01 met | 1.05 not met | - |\n"
        "| agc / default | <= 1.03 | 1.05 met (<= 1.06) | 1.02 met | 1.01 met |\n"
        "\n"
        "Measured here.\n"
    )


def test_a_script_s_results_are_the_files_it_reported(tmp_path, run_all, monkeypatch):
    """Not a JSON that another process wrote while the script ran."""
    monkeypatch.delitem(sys.modules, "harness", raising=False)
    write(
        tmp_path,
        "harness.py",
        "import json, os\nWRITTEN = []\n"
        "def report(name):\n"
        "    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'out')\n"
        "    WRITTEN.append(os.path.join(out, name + '.json'))\n"
        "    json.dump({'results': {}}, open(WRITTEN[-1], 'w'))\n",
    )
    script = '"""--quick"""\nimport json, os\nfrom harness import WRITTEN, report\n'
    script += "def main(argv=None):\n    report('a')\n    out = os.path.join(os.path.dirname(__file__), 'out')\n"
    script += "    for name in ('a_peaks', 'a_intruder'):\n"
    script += "        json.dump({}, open(os.path.join(out, name + '.json'), 'w'))\n"
    script += "    WRITTEN.append(os.path.join(out, 'a_peaks.json'))\n"
    write(tmp_path, "bench_a.py", script)
    (record,) = run_all.run_set(run_all.discover(), True, 60)
    # The stand-in leaves with this test (not through monkeypatch: its undo
    # would put the stand-in back); the delitem above restores the real one.
    sys.modules.pop("harness", None)
    assert sorted(record["outputs"]) == ["a.json", "a_peaks.json"]


def test_args_reach_every_script_and_page_names_the_output(tmp_path, run_all, monkeypatch):
    script = '"""--quick"""\nimport json, os\nHERE = os.path.dirname(os.path.abspath(__file__))\n'
    script += "def main(argv=None):\n    os.makedirs(os.path.join(HERE, 'out'), exist_ok=True)\n"
    script += "    json.dump({'results': {}, 'argv': argv},"
    script += " open(os.path.join(HERE, 'out', 'echo.json'), 'w'))\n"
    write(tmp_path, "bench_echo.py", script)
    child = str(tmp_path / "records.json")
    monkeypatch.setattr(run_all, "EXTRA_ARGV", [])
    argv = ["--quick", "--args", "--models a,b --rows 'x y'", "--child", child]
    assert run_all.main(argv + ["--dir", str(tmp_path)]) == 0
    with open(child) as f:
        (record,) = json.load(f)
    assert record["outputs"]["echo.json"]["argv"] == ["--quick", "--models", "a,b", "--rows", "x y"]
    # `--page`: its own file, its own run record, the docs' RESULTS table untouched
    written = {}
    monkeypatch.setattr(
        run_all, "run_processes", lambda n, quick, only, timeout: ([[record]], [1.0])
    )
    monkeypatch.setattr(run_all.speed_table, "sync_docs", lambda *a, **k: written.update(k) or [])
    assert run_all.main(["--page", "RESULTS-large", "--args", "--models a"]) == 0
    assert (tmp_path / "RESULTS-large.md").exists() and not (tmp_path / "RESULTS.md").exists()
    assert (tmp_path / "out" / "RESULTS-large.json").exists()
    assert written["page"] == "RESULTS-large"
    text = (tmp_path / "RESULTS-large.md").read_text()
    assert "--args '--models a' --page RESULTS-large" in text
    assert "<!-- speed-table-RESULTS-large:start -->" in text and "results.png" not in text
