"""`benchmarks/run_all.py`: discovery, running, target checks, the report.

Uses tiny stand-in benchmark scripts (plain Python, no TensorFlow) in a
temporary folder, so nothing here times anything."""

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.slow  # runs scripts in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_all(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "run_all_under_test", os.path.join(ROOT, "benchmarks", "run_all.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", str(tmp_path))
    monkeypatch.setattr(module, "OUT", str(tmp_path / "out"))
    return module


GOOD = '''"""Stand-in: two ratios.

    python bench_good.py [--quick]
"""
import json, os, sys
quick = "--quick" in sys.argv
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
os.makedirs(out, exist_ok=True)
results = {
    "a / b": {"median": 0.9 if quick else 1.2, "min": 0.8, "max": 1.1, "rounds": 5},
    "T=2: c / d": {"median": 1.5, "min": 1.4, "max": 1.6, "rounds": 5,
                   "best_epoch_ratio": 1.45},
}
targets = {"a / b": "<= 1.00", "T=2: c / d": "<= 1.05 at T=4"}
with open(os.path.join(out, "good.json"), "w") as f:
    json.dump({"machine": "test machine", "results": results, "targets": targets,
               "best_ms": {"a": 1.0}}, f)
with open(os.path.join(out, "good_peaks.json"), "w") as f:
    json.dump({"plain_512": [732.0, 740.5]}, f)
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_runs_scripts_in_quick_mode_and_collects_their_json(tmp_path, run_all):
    write(tmp_path, "bench_good.py", GOOD)
    write(tmp_path, "bench_noquick.py", '"""No quick mode."""\nraise SystemExit(3)\n')
    write(tmp_path, "bench_broken.py", '"""Fails. --quick"""\nraise RuntimeError("boom")\n')
    write(tmp_path, "bench_silent.py", '"""Writes nothing. --quick"""\n')
    write(tmp_path, "helper.py", "raise SystemExit('not a benchmark')\n")
    records = {r["name"]: r for r in (run_all.run_script(s, True, 60) for s in run_all.discover())}
    assert sorted(records) == ["broken", "good", "noquick", "silent"]
    good = records["good"]
    assert good["status"] == "ok" and good["title"] == "Stand-in: two ratios."
    assert good["outputs"]["good.json"]["results"]["a / b"]["median"] == 0.9  # --quick
    assert records["noquick"]["status"].startswith("not run: the script has no `--quick`")
    assert records["broken"]["status"].startswith("failed (exit 1)")
    assert "RuntimeError: boom" in records["broken"]["status"]
    assert records["silent"]["status"] == "ran, but wrote no JSON to benchmarks/out/"

    text = run_all.markdown(
        list(records.values()),
        "python benchmarks/run_all.py --quick",
        12.0,
        True,
        "test machine",
        (1.0, 2.0),
    )
    assert "shared 2-core CPU machine" in text
    assert "took **12 s** of wall time in quick mode" in text and "met)" in text
    assert "| a / b | 0.900 | 0.800 | 1.100 | 5 |  | <= 1.00 | pass |" in text
    # "at T=4" bounds only rows of T=4; extra per-row fields get a column.
    assert "| T=2: c / d | 1.500 | 1.400 | 1.600 | 5 | 1.450 | <= 1.05 at T=4 |  |" in text
    assert '"best_ms"' in text
    assert "| plain_512 | 732.000, 740.500 |" in text  # a JSON of other shape
    assert "## Micro-batching memory (issue 6, part 1)" in text
    assert run_all.plot(list(records.values()), str(tmp_path / "r.png"))
    with open(tmp_path / "r.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC


TARGET_CASES = [
    ("x", 1.02, "<= 1.03", "pass"),
    ("x", 1.04, "<= 1.03", "fail"),
    ("x", 0.99, "< 1 to switch", "pass"),
    ("x", 1.00, "< 1 to switch", "fail"),
    ("x", 2.5, ">= 2", "pass"),
    ("T=4: PCGrad / floor", 1.2, "<= 1.05 at T=4", "fail"),
    ("T=2: PCGrad / floor", 1.2, "<= 1.05 at T=4", ""),
    ("x", 2.0, "about 2 at T=4 (issue)", ""),
    ("x", 0.5, "lower is better", ""),
    ("x", 0.5, "", ""),
]


def test_targets_are_checked_against_the_median(run_all):
    for name, median, target, verdict in TARGET_CASES:
        assert run_all.check(name, median, target) == verdict, (name, median, target)


def test_main_writes_results_and_plot(tmp_path, run_all, capsys):
    write(tmp_path, "bench_good.py", GOOD)
    assert run_all.main(["--quick", "--only", "good"]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Written by `python benchmarks/run_all.py --quick --only good`" in text
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "out" / "good.json").read_text())["machine"]
    assert "bench_good.py: ok" in capsys.readouterr().out
