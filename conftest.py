"""Shared pytest setup: a clean Keras session per test and the doctest
namespace of the public docstrings' examples."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def clean_keras_state():
    """Every test starts from a fresh Keras session and float32 policy."""
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(autouse=True)
def doctest_namespace_setup(doctest_namespace):
    import tensorflow as tf

    import keras_fastgrad

    doctest_namespace.update({"np": np, "keras": keras, "tf": tf, "keras_fastgrad": keras_fastgrad})


def _shared_fixture_scope(item):
    """The module or session scoped fixtures of this repository that `item`
    uses (pytest's own, such as `tmp_path_factory`, do not count)."""
    info = getattr(item, "_fixtureinfo", None)
    names = []
    for name in getattr(info, "names_closure", ()):
        for definition in info.name2fixturedefs.get(name, ()):
            where = getattr(definition.func, "__module__", "") or ""
            if definition.scope in ("module", "session", "package") and not where.startswith(
                ("_pytest", "pytest", "xdist")
            ):
                names.append(f"{where}.{name}")
    return sorted(set(names))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Orders and groups the tests for `pytest -n 2` (pyproject's
    `--dist loadgroup`); a run without workers keeps the files' order.

    - The `slow` tests (whole programs in fresh processes, each seconds to
      minutes) first: they start while the short tests fill the other worker,
      and the run does not end with one worker on a long test while the
      other idles.
    - The tests that share a module or session scoped fixture (a process
      started once, a site built once) go to one worker
      (`xdist_group`), so that the fixture is made once, not once a worker.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        for name in _shared_fixture_scope(item):
            item.add_marker(pytest.mark.xdist_group(name))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
