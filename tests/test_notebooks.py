"""The notebooks in `notebooks/` run end to end, and are stored stripped.

Each notebook runs in a fresh Python process through `tools/run_notebook.py`
(its code cells in order, in one namespace, matplotlib on Agg): no Jupyter
needed. A failure shows the failing cell's index, source and traceback.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.tensorflow_only(reason="the notebooks run on TensorFlow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
RUNNER = os.path.join(ROOT, "tools", "run_notebook.py")
EXPECTED = (
    "01_quickstart.ipynb",
    "02_accumulation_and_mixed_precision.ipynb",
    "03_multitask.ipynb",
    "04_speed.ipynb",
)
# Each notebook is meant to run in under a minute on 2 CPU cores; the limit
# leaves room for a busy shared machine (the bound: 3 minutes).
TIMEOUT_S = 180


def notebook_names():
    return sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def run_notebook(path, timeout=TIMEOUT_S, executed=None):
    env = dict(os.environ)
    if executed is not None:
        env["KFG_EXECUTED_NOTEBOOKS"] = executed
    elif os.path.dirname(os.path.abspath(path)) != NOTEBOOKS:
        # Only the four notebooks go to the site's folder.
        env.pop("KFG_EXECUTED_NOTEBOOKS", None)
    else:
        # The folder the site's build reads by default (tools/mkdocs_hooks.py):
        # after the full tier, `mkdocs build` renders these copies and runs
        # no notebook again (docs/contributing.md).
        env.setdefault("KFG_EXECUTED_NOTEBOOKS", os.path.join(ROOT, "build", "executed-notebooks"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["MPLBACKEND"] = "Agg"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return subprocess.run(
        [sys.executable, RUNNER, path],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_the_four_notebooks_are_there():
    assert notebook_names() == list(EXPECTED)


@pytest.mark.slow  # a fresh process per notebook
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_end_to_end(name):
    result = run_notebook(os.path.join(NOTEBOOKS, name))
    assert result.returncode == 0, (
        f"{name} failed.\n--- stdout (end):\n{result.stdout[-3000:]}\n"
        f"--- stderr (end):\n{result.stderr[-6000:]}"
    )
    assert f"{name}: all cells ran" in result.stdout


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_stored_stripped_with_a_title(name):
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        notebook = json.load(f)
    assert notebook["nbformat"] == 4
    cells = notebook["cells"]
    first = cells[0]
    assert first["cell_type"] == "markdown"
    assert "".join(first["source"]).startswith("# "), "title cell first"
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert "keras.utils.set_random_seed(0)" in code[0], "seed set with the imports"
    for i, cell in enumerate(cells):
        assert "id" in cell and "metadata" in cell, f"cell {i}"
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {i} has outputs: strip them"
            assert cell["execution_count"] is None, f"cell {i} execution_count"


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_ends_with_what_you_saw(name):
    # The last two cells: a "What you saw" heading, then code that prints the
    # numbers the notebook measured (from its variables, not typed in).
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    heading, code = cells[-2], cells[-1]
    assert heading["cell_type"] == "markdown"
    assert "".join(heading["source"]).startswith("## What you saw")
    assert code["cell_type"] == "code"
    source = "".join(code["source"])
    assert "print(" in source and "{" in source, "print computed values (f-strings)"


def write_notebook(path, *sources):
    cells = [
        {
            "cell_type": "code",
            "id": str(i),
            "metadata": {},
            "source": s,
            "execution_count": None,
            "outputs": [],
        }
        for i, s in enumerate(sources)
    ]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, f)


@pytest.mark.slow  # a fresh process
def test_runner_shares_the_namespace_and_shows_the_last_value(tmp_path):
    path = str(tmp_path / "ok.ipynb")
    write_notebook(path, "value = 20", "value + 22")
    result = run_notebook(path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "42" in result.stdout


@pytest.mark.slow  # a fresh process
def test_runner_names_the_failing_cell_and_its_source(tmp_path):
    path = str(tmp_path / "bad.ipynb")
    write_notebook(
        path,
        "x = 1",
        textwrap.dedent("""\
        y = x + 1
        raise RuntimeError('boom in the second cell')"""),
    )
    result = run_notebook(path, timeout=60)
    assert result.returncode == 1
    assert "bad.ipynb: cell 1 failed" in result.stderr
    assert "raise RuntimeError('boom in the second cell')" in result.stderr
    assert "RuntimeError: boom in the second cell" in result.stderr


@pytest.mark.slow  # a fresh process
def test_runner_writes_the_executed_notebook_with_outputs(tmp_path):
    path = str(tmp_path / "shown.ipynb")
    write_notebook(
        path,
        "print('hello')",
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
        "6 * 7",
    )
    result = run_notebook(path, timeout=60, executed=str(tmp_path / "executed"))
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "executed" / "shown.ipynb", encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    assert [c["execution_count"] for c in cells] == [1, 2, 3]
    assert cells[0]["outputs"][0]["text"] == "hello\n"
    assert "image/png" in cells[1]["outputs"][-1]["data"]
    assert cells[2]["outputs"][0]["text"] == "42\n"
    # The stored notebook is left stripped.
    with open(path, encoding="utf-8") as f:
        assert all(c["outputs"] == [] for c in json.load(f)["cells"])


@pytest.mark.slow  # a fresh process
def test_runner_refuses_ipython_magics(tmp_path):
    path = str(tmp_path / "magic.ipynb")
    write_notebook(path, "%matplotlib inline\nx = 1")
    result = run_notebook(path, timeout=60)
    assert result.returncode == 1
    assert "IPython magic" in result.stderr
