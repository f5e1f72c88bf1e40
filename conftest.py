"""Shared pytest setup: a clean Keras session per test and the doctest
namespace of the public docstrings' examples."""

import functools
import importlib.util
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The only backend keras_fastgrad supports (its import refuses the others):
# chosen here, before Keras loads, for the tests and every subprocess they
# start, whatever the shell or ~/.keras/keras.json selects.
# `KERAS_BACKEND=jax` is kept: the suite runs under it too (the files and
# tests of one backend alone are marked `tensorflow_only` or `jax_only`).
if os.environ.get("KERAS_BACKEND") != "jax":
    os.environ["KERAS_BACKEND"] = "tensorflow"
# Under JAX, XLA's executables cached on disk (build/, ignored by git) and
# shared by the workers: the tests compile many identical steps (the same
# small models and options, another test's names; the cache key strips
# them), and a cache hit skips XLA's compilation, not the trace, so a
# retrace is still a retrace. Measured on the JAX exactness and
# BatchNorm files, from an empty cache: 183 s -> 147 s (two workers); CI's
# JAX stage 743 s -> 647 s, the same session.
if os.environ["KERAS_BACKEND"] == "jax":
    _cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "jax-cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # And XLA's CPU code generated at LLVM's optimisation level 0: compiling
    # is most of a JAX test's time, and the steps run a few batches. XLA's
    # own passes (fusion, simplification: what decides the numerics) still
    # run; the benchmarks (not under pytest) run XLA as users do. Measured
    # on those two files, with the cache: 147 s -> 108 s.
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        ).strip()

# Before Keras: keras_fastgrad imports TensorFlow and holds the notices it
# prints while imported to TF_CPP_MIN_LOG_LEVEL (keras_fastgrad/_tf_startup.py).
import keras_fastgrad  # noqa: E402, I001
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tests import tiers  # noqa: E402  (tests/tiers.py: which tests are in the full tier)


@pytest.fixture(autouse=True)
def clean_keras_state():
    """Every test starts from a fresh Keras session and float32 policy.

    A full `gc.collect()` (Keras' `free_memory=True`) runs after every
    eighth test, not after each: a collection walks ~250k-470k objects
    (0.25-0.7 s of CPU, measured under TensorFlow and JAX) even when there
    is nothing to free, and Python's own generational collections run in
    between."""
    keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")
    _TESTS_RUN[0] += 1
    keras.backend.clear_session(free_memory=_TESTS_RUN[0] % 8 == 0)


_TESTS_RUN = [0]  # (this process's)


@pytest.fixture(autouse=True)
def doctest_namespace_setup(doctest_namespace):
    names = {"np": np, "keras": keras, "keras_fastgrad": keras_fastgrad}
    if keras.backend.backend() == "tensorflow":  # (not imported under JAX: the
        import tensorflow as tf  # doctests that run there use keras.ops and numpy)

        names["tf"] = tf
    doctest_namespace.update(names)


# Test files whose tests share a module-scoped fixture that starts a process
# (test_distributed.py: the MirroredStrategy cases, minutes): under
# `pytest -n 2` each goes to one worker as a whole, so that the fixture runs
# once, not once a worker. (`xdist_group` marks would say this per test, but
# pytest-xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads:
# the marks are silently ignored.)
ONE_WORKER_FILES = (
    "tests/end_to_end/test_distributed.py",
    "tests/end_to_end/test_data_parallel_jax.py",  # (its 2-device process, ~20 s)
    "tests/end_to_end/test_model_parallel_jax.py",  # (its 8-device process, ~18 s)
    "tests/end_to_end/test_multiprocess_jax.py",  # (its 2 processes, ~30 s)
)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (pyproject.toml) as one unit a test, except the
    files of `ONE_WORKER_FILES` (one unit each, started first): each worker
    holds at most three tests ahead, so both stay busy to the end."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER_FILES else nodeid

    return Scheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # the tiers' marks, before `-m` selects by them
def pytest_collection_modifyitems(config, items):
    """The `full` mark on the tests of the full tier (tests/tiers.py; the
    README's command, `addopts`' `-m "not full"`, leaves them out). Files
    or tests named on the command line run whatever their tier, unless
    `-m` says otherwise.

    Under `pytest -n 2`, the `slow` tests (whole programs in fresh
    processes, each seconds to minutes) first: they start while the short
    tests fill the other worker, and the run does not end with one worker
    on a long test while the other idles. A run without workers keeps the
    files' order.

    Under `KERAS_BACKEND=jax`, a doctest whose example names `tf` (the
    doctests' namespace has no `tf` there) is marked `tensorflow_only`."""
    if keras.backend.backend() == "jax":
        for item in items:
            examples = getattr(getattr(item, "dtest", None), "examples", ())
            if any(_NAMES_TF.search(example.source) for example in examples):
                item.add_marker(pytest.mark.tensorflow_only(reason="its example uses `tf`"))
    if config.args_source == pytest.Config.ArgsSource.ARGS and not _m_given(config):
        return  # files or tests named on the command line run, whatever their tier
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        name = getattr(item, "originalname", item.name)
        slow = item.get_closest_marker("slow") is not None
        if tiers.is_full(path, name, slow, keras.backend.backend()):
            item.add_marker(pytest.mark.full)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_NAMES_TF = re.compile(r"\btf\.")


def pytest_ignore_collect(collection_path, config):
    """A module of one backend is not collected under the other (it may
    import a package that backend's venv lacks: `jax` in the README's
    TensorFlow venv, `tensorflow` in docs/jax.md's JAX venv): its
    module-level `tensorflow_only` or `jax_only` mark, its name
    (`*_jax.py`), or its top-level import of `tensorflow` or `jax`
    (`tiers.only_backend`)."""
    if collection_path.suffix != ".py" or not collection_path.is_file():
        return None
    only = _only_backend(str(collection_path))
    if only is None or only == keras.backend.backend():
        return None
    return True


@functools.cache
def _only_backend(path):
    with open(path, encoding="utf-8") as file:
        return tiers.only_backend(path, file.read())


# (mark, the backend that skips its tests, the reason a mark without one gives)
_ONLY_MARKS = (
    ("tensorflow_only", "jax", "TensorFlow only"),
    ("jax_only", "tensorflow", "JAX only"),
)


def pytest_runtest_setup(item):
    """A test marked `tensorflow_only` (what it checks exists on TensorFlow
    alone: `tf.function`, strategies, sparse gradients) is skipped under
    `KERAS_BACKEND=jax`, one marked `jax_only` under TensorFlow, with its
    mark's reason. A test marked `needs_tensorflow` is skipped where
    TensorFlow is not installed."""
    for name, other, default in _ONLY_MARKS:
        mark = item.get_closest_marker(name)
        if mark is not None and keras.backend.backend() == other:
            pytest.skip(mark.kwargs.get("reason") or (mark.args[0] if mark.args else default))
    mark = item.get_closest_marker("needs_tensorflow")
    if mark is not None and not _TENSORFLOW_INSTALLED:
        why = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
        pytest.skip(f"needs TensorFlow, not installed in this venv ({why})")


_TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None


def _m_given(config):
    """Whether the command line (not `addopts`) has `-m`."""
    return any(a.startswith("-m") for a in config.invocation_params.args)


def _selects_the_full_tier(config):
    return config.getoption("markexpr", "").strip() == "full"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In the full tier (`-m full`), a test that skips itself (a module it
    needs is missing, `pytest.importorskip`) fails, naming the fix: that
    tier runs everything it selects. A skip declared by a `skip` or
    `skipif` mark (the installed versions) or by `tensorflow_only` or
    `jax_only` on the other backend stays a skip, and an expected failure (`xfail`) stays one."""
    report = yield
    declared = (
        item.get_closest_marker("skip")
        or item.get_closest_marker("skipif")
        or any(
            item.get_closest_marker(name) and keras.backend.backend() == other
            for name, other, _ in _ONLY_MARKS
        )
        or (item.get_closest_marker("needs_tensorflow") and not _TENSORFLOW_INSTALLED)
        or hasattr(report, "wasxfail")
    )
    if report.skipped and _selects_the_full_tier(item.config) and not declared:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} skipped in the full tier, which runs every test it "
            f"selects. Received: {reason}. Fix: install what it needs (README, "
            "Tests: the full tier's line installs KerasHub), or declare the "
            "skip with a `skipif` mark on the versions it needs."
        )
    return report
