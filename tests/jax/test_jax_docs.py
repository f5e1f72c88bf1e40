"""The getting-started page's code runs on Keras' JAX backend as shown
(`tests/test_docs.py` runs every page on TensorFlow): the page promises the
same classes and options on both backends."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join("docs", "getting-started.md")]


def code_blocks(page):
    spec = importlib.util.spec_from_file_location(
        "test_docs_blocks", os.path.join(ROOT, "tests", "test_docs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # parses the site's pages; runs nothing
    return module.code_blocks(page)


@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs_on_jax(page, tmp_path, monkeypatch):
    import keras

    assert keras.backend.backend() == "jax"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    ran = 0
    for block in code_blocks(page):
        if block.not_run:
            continue
        code = compile(block.source, f"{page}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(
                f"The code block at {page}:{block.line} fails on JAX as shown "
                f"({type(error).__name__}: {error}). Its source:\n{block.source}"
            ) from error
        ran += 1
    assert ran >= 3  # the data, the functional model, the subclass
