"""The step's layout, checked (docs/architecture.md): the backend-neutral
core imports neither TensorFlow nor JAX, nor a shell; each rule of the step
is defined in the core and in no shell; the architecture page quotes the
figures `tools/step_lines.py` prints for the tree as it is."""

import ast
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "keras_fastgrad"

# The backend-neutral core: every decision of the step.
CORE = ("keras_fastgrad/step", "keras_fastgrad/maths")
# The shells: how the step runs on each backend.
SHELLS = ("keras_fastgrad/backend/tensorflow", "keras_fastgrad/backend/jax")
# What a core module may not import (a shell imports its backend).
BACKEND_MODULES = (
    "tensorflow",
    "jax",
    "keras_fastgrad._tf_startup",
    "keras_fastgrad.backend.tensorflow",
    "keras_fastgrad.backend.jax",
)

# Each rule of the step (issue 50's list): the core module that decides it
# and the names it defines there. No shell module defines these names.
RULES = {}


def _step_lines():
    spec = importlib.util.spec_from_file_location("step_lines", REPO / "tools" / "step_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules(folders):
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def _imports(tree):
    """Every module name an import statement of `tree` names (function-level
    imports too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def backend_imports(source):
    """The backend or shell modules `source` imports (sorted)."""
    return sorted(
        name
        for name in _imports(ast.parse(source))
        if any(name == b or name.startswith(b + ".") for b in BACKEND_MODULES)
    )


def defined_names(source):
    """The names a module defines at its top level (functions, classes,
    assignments)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_the_checkers_find_planted_violations():
    planted = (
        "import numpy\n"
        "from keras_fastgrad._tf_startup import tf\n"
        "def f():\n"
        "    import jax.numpy as jnp\n"
        "    from keras_fastgrad.backend.tensorflow import slicing\n"
        "window_weight = 1\n"
        "class Verdict: pass\n"
    )
    assert backend_imports(planted) == [
        "jax.numpy",
        "keras_fastgrad._tf_startup",
        "keras_fastgrad._tf_startup.tf",
        "keras_fastgrad.backend.tensorflow",
        "keras_fastgrad.backend.tensorflow.slicing",
    ]
    assert defined_names(planted) == {"f", "window_weight", "Verdict"}
    assert backend_imports("import keras\nfrom keras import ops\nimport jaxtyping\n") == []


@pytest.mark.parametrize("path", _modules(CORE), ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_core_module_imports_no_backend_and_no_shell(path):
    found = backend_imports(path.read_text())
    assert not found, (
        f"{path.relative_to(REPO)} is in the backend-neutral core ({', '.join(CORE)}) "
        f"but imports {found}. Fix: write the rule with `keras.ops` (or take the "
        "backend's primitive as an argument) and move what only one backend does "
        f"to its shell ({', '.join(SHELLS)})."
    )


def test_every_rule_is_defined_in_the_core_and_in_no_shell():
    shells = {p: defined_names(p.read_text()) for p in _modules(SHELLS)}
    problems = []
    for rule, (module, names) in RULES.items():
        path = REPO / (module.replace(".", "/") + ".py")
        if not any(path.is_relative_to(REPO / c) for c in CORE):
            problems.append(f"{rule}: {module} is not a core module")
            continue
        missing = set(names) - defined_names(path.read_text())
        if missing:
            problems.append(f"{rule}: {module} defines no {sorted(missing)}")
        for shell, defined in shells.items():
            again = set(names) & defined
            if again:
                problems.append(f"{rule}: {shell.relative_to(REPO)} defines {sorted(again)} again")
    assert not problems, (
        "Each rule of the step is written once, in the core, and called by the "
        "shells: " + "; ".join(problems)
    )


def test_the_line_counter_counts_code_lines_only():
    step_lines = _step_lines()
    source = (
        '"""Module\ndocstring."""\n\n'
        "# a comment\n"
        "import jax\n"
        "def f(x):\n"
        '    """Doc."""\n'
        "    return x  # trailing\n"
    )
    assert step_lines.code_lines(source) == 3
    assert step_lines.backend_of(source) == "jax"
    assert step_lines.backend_of("def g():\n    import tensorflow as tf\n") == "tensorflow"
    assert step_lines.backend_of("from keras_fastgrad._tf_startup import tf\n") == "tensorflow"
    assert step_lines.backend_of("import keras\n") == "neither"


def test_the_architecture_page_quotes_the_current_figures():
    step_lines = _step_lines()
    rows, totals = step_lines.count()
    share = f"{totals['neither'] / sum(totals.values()):.1%}"
    page = (REPO / "docs" / "architecture.md").read_text()
    expected = [share] + [
        f"{step_lines.shell_lines(rows, shell)} lines" for shell in ("tensorflow", "jax")
    ]
    missing = [text for text in expected if text not in page]
    assert not missing, (
        f"docs/architecture.md does not quote {missing} (`python tools/step_lines.py` "
        "prints them for the tree as it is). Fix: update the page's figures."
    )
