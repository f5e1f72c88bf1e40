"""The two test tiers (tests/tiers.py): every entry names a test that
exists, the README's and CI's commands select complementary sets, and the
fast tier still touches every option, callback, aggregator, `fastgrad()`
and saving (read from the test functions' source: one that names it)."""

import ast
import pathlib
import re

import keras
import pytest

import keras_fastgrad
from keras_fastgrad import aggregators
from keras_fastgrad.models.model import OPTION_NAMES
from tests import tiers

pytestmark = pytest.mark.tensorflow_only(
    reason="the suite's tiers, checked once (in the TensorFlow run)"
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _is_slow(decorators):
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def _test_functions():
    """`(path, name, source, slow)` of every test function under tests/,
    `source` with its decorators (the parametrizations)."""
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        module_slow = any(
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            and "mark.slow" in ast.unparse(node.value)
            for node in tree.body
        )
        nodes = list(tree.body)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            nodes += [n for n in cls.body]
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
                "test"
            ):
                source = "\n".join(ast.unparse(d) for d in node.decorator_list)
                source += "\n" + ast.get_source_segment(text, node)
                slow = module_slow or _is_slow(node.decorator_list)
                yield path.relative_to(REPO).as_posix(), node.name, source, slow


def test_every_full_tier_entry_names_a_test_that_exists():
    found = {(path, name) for path, name, _, _ in _test_functions()}
    files = {path for path, _ in found}
    missing = [p for p in (*tiers.FULL_FILES, *tiers.FULL_ON_TENSORFLOW) if p not in files]
    missing += [f"{p}::{n}" for p, n in tiers.FULL_TESTS if (p, n) not in found]
    assert not missing, (
        f"tests/tiers.py names tests that do not exist: {missing}. Fix: update "
        "the entry to the test's new file or name (a stale entry moves its "
        "test to the fast tier, which then takes longer than the README says)."
    )


def test_the_commands_select_complementary_tiers(pytestconfig):
    # The fast tier is `-m "not full"` (addopts), the full tier `-m full`:
    # together every test, each once.
    assert pytestconfig.getini("addopts")[-2:] == ["-m", "not full"]
    # The README's commands (CI runs them as written: .ci/run reads them
    # out of README.md, tests/test_documented_commands.py).
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -q -n 2\n" in readme
    assert ".venv/bin/python -m pytest -q -n 2 -m full" in readme
    assert 'documented README.md "Quick start"' in ci and 'documented README.md "Tests"' in ci


def test_the_fast_tier_touches_every_option_callback_and_aggregator():
    fast = "\n".join(
        source
        for path, name, source, slow in _test_functions()
        if not tiers.is_full(path, name, slow)
    )
    callbacks = [
        n
        for n in keras_fastgrad.callbacks.__all__
        if isinstance(getattr(keras_fastgrad.callbacks, n), type)
        and issubclass(getattr(keras_fastgrad.callbacks, n), keras.callbacks.Callback)
        and n != "FastGradCallback"
    ]
    names = list(OPTION_NAMES) + callbacks
    names += ["fastgrad", "FastGradSequential", "profile_step", "load_model", "save_weights"]
    untouched = [n for n in names if not re.search(rf"\b{n}\b", fast)]
    for name in aggregators.NAMES:
        cls = type(aggregators.get(name)).__name__
        if f'"{name}"' not in fast and not re.search(rf"\b{cls}\b", fast):
            untouched.append(f"aggregator {name!r} ({cls})")
    assert callbacks and not untouched, (
        f"No test of the fast tier names {untouched}. Fix: keep (or write) one "
        "short test of it out of tests/tiers.py's lists."
    )


def test_only_backend_reads_the_mark_the_name_the_shell_and_the_imports():
    tf_mark = 'import pytest\npytestmark = pytest.mark.tensorflow_only(reason="x")\n'
    jax_mark = 'import pytest\npytestmark = [pytest.mark.slow, pytest.mark.jax_only(reason="x")]\n'
    assert tiers.only_backend("tests/test_a.py", tf_mark) == "tensorflow"
    assert tiers.only_backend("tests/step/test_a.py", jax_mark) == "jax"
    # The mark wins over the name (tests/test_without_jax.py is TensorFlow's).
    assert tiers.only_backend("tests/test_without_jax.py", tf_mark) == "tensorflow"
    assert tiers.only_backend("tests/step/test_units_jax.py", "import keras\n") == "jax"
    assert tiers.only_backend("keras_fastgrad/backend/jax/step.py", "") == "jax"
    assert tiers.only_backend("keras_fastgrad/backend/tensorflow/a.py", "") == "tensorflow"
    assert tiers.only_backend("tests/test_a.py", "import tensorflow as tf\n") == "tensorflow"
    assert tiers.only_backend("a.py", "from keras_fastgrad._tf_startup import tf\n") == "tensorflow"
    assert tiers.only_backend("tests/test_a.py", "import jax.numpy as jnp\n") == "jax"
    # Imports inside a function, and the lazy `tf` of tests/helpers.py: both.
    both = "from tests.helpers import tf\n\ndef f():\n    import tensorflow\n"
    assert tiers.only_backend("tests/test_a.py", both) is None
    assert tiers.only_backend("keras_fastgrad/step/support.py", "import keras\n") is None


def test_a_file_both_backends_collect_imports_no_module_of_one_backend():
    # A test file that runs under both imports at its top level no module of
    # tests/ that is one backend's alone (the other's venv may lack it).
    def backend(path):
        return tiers.only_backend(path.relative_to(REPO).as_posix(), path.read_text())

    wrong = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if backend(path) is not None:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                target = REPO / (node.module.replace(".", "/") + ".py")
                if target.exists() and backend(target) is not None:
                    wrong.append(f"{path.relative_to(REPO)} imports {node.module}")
    assert not wrong, (
        f"{wrong}: collected under both backends, they import a module of one. "
        "Fix: mark the file (`pytestmark = pytest.mark.tensorflow_only(reason=...)` "
        "or `jax_only`), or import that module inside the tests that need it."
    )
