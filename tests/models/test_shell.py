"""`FastGradModel` picks its backend's shell once (`backend.shell()`), as
Keras' `Model` picks its trainer: both shells define the same entry points,
and the model's modules ask no "which backend?" of their own."""

import ast
import pathlib

import keras
import pytest

import keras_fastgrad
from keras_fastgrad import backend
from keras_fastgrad.step import trainer as core

PACKAGE_DIR = pathlib.Path(keras_fastgrad.__file__).parent
SHELLS = {name: PACKAGE_DIR / "backend" / name / "trainer.py" for name in ("tensorflow", "jax")}


def _top_level_names(path):
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_both_shells_define_every_entry_point():
    for name, path in SHELLS.items():
        missing = set(core.SHELL_ENTRY_POINTS) - _top_level_names(path)
        assert not missing, f"backend/{name}/trainer.py lacks {sorted(missing)}"


def test_the_shell_is_picked_once_for_the_backend_keras_runs_on():
    shell = backend.shell()
    assert shell is backend.shell()
    assert shell.NAME == keras.backend.backend()
    assert shell.__name__ == f"keras_fastgrad.backend.{shell.NAME}.trainer"


def test_the_models_ask_the_shell_not_the_backend():
    # Each of these once branched on `is_jax()`; they call the shell now.
    paths = [
        *sorted((PACKAGE_DIR / "models").glob("*.py")),
        PACKAGE_DIR / "callbacks" / "retrace_watch.py",
        PACKAGE_DIR / "profiling" / "measure.py",
        PACKAGE_DIR / "backend" / "__init__.py",
    ]
    asking = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            called = isinstance(node, ast.Call) and ast.unparse(node.func).endswith("is_jax")
            if called and path.name != "__init__.py":
                asking.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
            if isinstance(node, ast.Compare) and "backend.backend()" in ast.unparse(node):
                if path.name != "__init__.py":
                    asking.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
    assert not asking, f"these ask which backend instead of calling backend.shell(): {asking}"


def test_a_model_option_the_record_refuses_on_the_running_backend_is_refused(monkeypatch):
    # Through `FastGradModel`: the backend's `check_options` passes the
    # running shell's name, so a row refused there stops the model, by name.
    from keras_fastgrad.step import support

    running = keras.backend.backend()
    row = support.Feature(
        "`clip_norm`", note="a test's row", key="clip_norm", **{running: support.REFUSED}
    )
    monkeypatch.setattr(support, "JAX_REFUSALS", {"clip_norm": row})
    monkeypatch.setattr(core, "JAX_REFUSALS", {"clip_norm": row})

    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    keras_fastgrad.FastGradModel(inputs, outputs)  # at its default: not refused
    with pytest.raises(NotImplementedError, match=r"Received: clip_norm=1\.0 with"):
        keras_fastgrad.FastGradModel(inputs, outputs, clip_norm=1.0)
