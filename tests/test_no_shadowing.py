"""No folder of the repository stands in for a package a user's venv lacks.

A folder without `__init__.py` on `sys.path` imports as a namespace package
wherever no real package of that name is installed: `tests/jax` did, on
`sys.path` through the tests' setup, and Keras' optional import of `jax`
found it in the README's venv (no JAX), which broke every test run and the
docs build. Here: nothing puts `tests/` (or a folder under it) on
`sys.path`, and no folder or module that lands on `sys.path` (the
repository's root, pytest's and the subprocesses'; `tools/`,
`benchmarks/` and `tests/data/`, whose scripts run as files) is named like
a module that Keras or keras_fastgrad import.
"""

import importlib.util
import os
import re
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# Folders that land on sys.path: the root (pytest's rootdir, PYTHONPATH of
# the tests' subprocesses) and those whose scripts run as files.
ON_SYS_PATH = ("", "tools", "benchmarks", os.path.join("tests", "data"))
OURS = {"keras_fastgrad", "tests", "conftest"}  # the repository's own (conftest: pytest's)
# Modules that Keras and TensorFlow import where they are installed, and the
# project's optional dependencies: what a stand-in would fool.
OPTIONAL = {
    "jax",
    "jaxlib",
    "tensorflow",
    "torch",
    "openvino",
    "orbax",
    "keras_hub",
    "grain",
    "flax",
    "tf_keras",
    "sklearn",
    "scipy",
    "matplotlib",
    "mkdocs",
    "playwright",
    "h5py",
}


def imported_names(folder):
    """Top-level names that the `.py` files under `folder` import."""
    names = set()
    pattern = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.M)
    for path, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(path, name), encoding="utf-8", errors="replace") as f:
                    names.update(pattern.findall(f.read()))
    return names


@pytest.fixture(scope="module")
def guarded_names():
    keras_src = os.path.dirname(os.path.abspath(keras.src.__file__))
    names = imported_names(keras_src) | imported_names(os.path.join(ROOT, "keras_fastgrad"))
    return (names | OPTIONAL) - OURS - set(sys.builtin_module_names)


def test_no_test_folder_is_on_sys_path():
    on_path = [
        p
        for p in sys.path
        if os.path.abspath(p or ".").startswith(TESTS + os.sep)
        or os.path.abspath(p or ".") == TESTS
    ]
    assert not on_path, (
        f"sys.path holds test folders: {on_path}. Fix: import test modules as "
        "the package they are (`from tests.helpers import ...`); run scripts "
        "with `python -m tests.<name>` from the repository's root."
    )


def test_nothing_on_sys_path_is_named_like_a_module_keras_imports(guarded_names):
    clashes = []
    for folder in ON_SYS_PATH:
        for entry in sorted(os.listdir(os.path.join(ROOT, folder))):
            name = entry[: -len(".py")] if entry.endswith(".py") else entry
            full = os.path.join(ROOT, folder, entry)
            if (os.path.isdir(full) or entry.endswith(".py")) and name in guarded_names:
                clashes.append(os.path.join(folder, entry))
    assert not clashes, (
        f"{clashes} would import in place of the module of that name where it "
        "is not installed (these folders are on sys.path for the tests or "
        "their scripts). Fix: rename them."
    )


def test_every_module_keras_imports_resolves_outside_the_repository(guarded_names):
    inside = []
    for name in sorted(guarded_names):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        places = [spec.origin] if spec.origin else []
        places += list(spec.submodule_search_locations or [])
        # (a venv inside the checkout holds the real ones: site-packages)
        stand_ins = [
            p
            for p in places
            if p and os.path.isabs(p) and p.startswith(ROOT + os.sep) and "site-packages" not in p
        ]
        if stand_ins:
            inside.append(f"{name}: {stand_ins}")
    assert not inside, (
        f"modules that Keras or keras_fastgrad import resolve to the "
        f"repository: {inside}. Fix: rename the folder, keep it off sys.path."
    )
