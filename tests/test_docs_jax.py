"""Every page's code runs on Keras' JAX backend as shown: the pages promise
the same classes and options on both backends. `tests/test_docs.py` runs
them on TensorFlow (in the full tier there); this runs its own
`test_page_code_runs` on every page under JAX (in the JAX stage of CI),
and the pages' JAX programs that need several devices or processes
(`<!-- script: backend=jax ... -->`) in processes of their own."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_docs():
    spec = importlib.util.spec_from_file_location(
        "test_docs_pages", os.path.join(ROOT, "tests", "test_docs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # parses the site's pages; runs nothing
    return module


TEST_DOCS = _test_docs()


@pytest.mark.parametrize("page", TEST_DOCS.RUN_PAGES)
def test_page_code_runs_on_jax(page, tmp_path, monkeypatch):
    import keras

    assert keras.backend.backend() == "jax"
    TEST_DOCS.test_page_code_runs(page, tmp_path, monkeypatch)


def test_the_getting_started_page_runs_here():
    assert os.path.join("docs", "getting-started.md") in TEST_DOCS.RUN_PAGES


@pytest.mark.parametrize(
    "block",
    [b for b in TEST_DOCS.SCRIPTS if dict(b.script)["backend"] == "jax"],
    ids=lambda b: b.name,
)
def test_script_block_runs_on_jax(block, tmp_path):
    TEST_DOCS.run_script(block, tmp_path)
