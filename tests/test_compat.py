"""Canary for the private Keras/TensorFlow API that keras_fastgrad uses.

Every private name lives in `keras_fastgrad/_compat/` (a module per
library it bridges: `keras.py`, `tensorflow.py`, `jax.py`). These tests
check that each still exists in the installed Keras and TensorFlow, takes
the arguments we pass, and is still called by Keras where we override it;
and that no other module reaches into private API. A Keras upgrade that
moves something fails here first, with the name in the message.
"""

import ast
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastgrad
from keras_fastgrad import _compat as compat

PACKAGE_DIR = pathlib.Path(keras_fastgrad.__file__).parent
COMPAT_DIR = PACKAGE_DIR / "_compat"
COMPAT_FILES = frozenset(COMPAT_DIR.glob("*.py"))


def _compiled_model():
    inputs = keras.Input((3,))
    a = keras.layers.Dense(1, name="a")(inputs)
    b = keras.layers.Dense(1, name="b")(inputs)
    model = keras.Model(inputs, {"a": a, "b": b})
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"})
    x = np.ones((2, 3), "float32")
    y = {"a": np.zeros((2, 1), "float32"), "b": np.zeros((2, 1), "float32")}
    model.compute_loss(x, y, model(x))  # builds the `CompileLoss`
    return model


def _owner(name):
    if name == "keras.Model":
        return _compiled_model()
    if name == "CompileLoss":
        return compat.compile_loss(_compiled_model())
    if name == "keras.Variable":
        return keras.Variable
    if name == "Functional":
        return _compiled_model()
    if name == "KerasTensor":
        return keras.layers.Dense(1)(keras.Input((3,)))
    if name == "keras.Operation":
        layer = keras.layers.Dense(1)
        layer(keras.Input((3,)))
        return layer
    if name == "keras.layers.BatchNormalization":
        return keras.layers.BatchNormalization
    if name == "tf.distribute.StrategyExtended":
        return tf.distribute.MirroredStrategy(["/cpu:0"]).extended
    return importlib.import_module(name)


def _parameters(fn):
    return set(inspect.signature(fn).parameters)


@pytest.mark.parametrize(
    "owner, name", compat.PRIVATE_NAMES, ids=[f"{o}.{n}" for o, n in compat.PRIVATE_NAMES]
)
def test_private_name_exists(owner, name):
    if owner == "keras.Variable" and compat._VARIABLE_HAS_SYNCHRONIZATION:
        pytest.skip("used only where `keras.Variable` has no `synchronization`")
    assert hasattr(_owner(owner), name), (
        f"keras {keras.__version__} / tensorflow {tf.__version__} has no "
        f"`{owner}.{name}`, which keras_fastgrad/_compat/ uses. "
        "Fix: add a version branch for it there."
    )


def test_private_functions_take_the_arguments_we_pass():
    from keras.src.losses import loss as loss_module
    from keras.src.models import cloning

    model = _compiled_model()
    assert {"x", "y", "y_pred", "sample_weight", "training"} <= _parameters(model._compute_loss)
    assert "data_batch" in _parameters(model._symbolic_build)
    assert {"sample_weight", "mask", "dtype", "reduction"} <= _parameters(loss_module.apply_mask)
    assert {"values", "sample_weight", "mask", "reduction", "dtype"} <= _parameters(
        loss_module.reduce_weighted_values
    )
    # `model_cloned_in` reads the original from this local variable.
    assert "model" in cloning._clone_functional_model.__code__.co_varnames
    assert compat._CLONE_FUNCTIONAL_CODE is cloning._clone_functional_model.__code__


def test_compile_loss_entries_have_the_fields_we_use():
    entries = compat.output_losses(compat.compile_loss(_compiled_model()))
    assert [e.name for e in entries] == ["a", "b"]
    for entry in entries:
        assert {"path", "loss", "loss_weights", "name"} <= set(entry._fields)
    assert compat.user_loss(compat.compile_loss(_compiled_model())) == {"a": "mse", "b": "mae"}


def test_compile_loss_builds_itself_on_its_first_call():
    from keras.src.trainers.compile_utils import CompileLoss

    assert {"y_true", "y_pred"} <= _parameters(CompileLoss.build)
    assert "self.build(" in inspect.getsource(CompileLoss)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    compile_loss = compat.compile_loss(model)
    assert not compile_loss.built
    installed = []
    with compat.once_built(compile_loss, lambda: installed.append(True)):
        assert not installed
        model.compute_loss(np.ones((2, 3)), np.ones((2, 1)), model(np.ones((2, 3))))
        assert installed == [True]
    assert "build" not in vars(compile_loss)


def test_loss_tracker_is_a_mean_metric():
    model = _compiled_model()
    assert isinstance(compat.loss_tracker(model), keras.metrics.Mean)
    tracker = keras.metrics.Mean(name="loss")
    compat.set_loss_tracker(model, tracker)
    assert compat.loss_tracker(model) is tracker


@pytest.mark.parametrize(
    "cls, name, parameters",
    compat.OVERRIDDEN_PRIVATE_METHODS,
    ids=[n for _, n, _ in compat.OVERRIDDEN_PRIVATE_METHODS],
)
def test_overridden_private_method_exists_with_its_arguments(cls, name, parameters):
    method = getattr(cls, name, None)
    assert callable(method), (
        f"keras {keras.__version__} has no `{cls.__name__}.{name}`, which "
        "keras_fastgrad overrides. Fix: find where Keras now does that work "
        "and move the override there (see `keras_fastgrad/_compat/`)."
    )
    assert set(parameters) <= _parameters(method)


def test_keras_still_calls_the_methods_we_override():
    from keras.src.saving import saving_lib

    fit_source = inspect.getsource(type(_compiled_model()).fit)
    assert "_maybe_symbolic_build" in fit_source
    assert "_get_metrics_result_or_logs" in fit_source
    assert "_obj_type" in inspect.getsource(saving_lib)
    assert compat.SAVEABLE_OBJ_TYPE in inspect.getsource(saving_lib)


def test_first_batch_reads_fits_epoch_iterator():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    x = np.arange(12, dtype="float32").reshape(6, 2)
    iterator = TFEpochIterator(x=x, batch_size=4, distribute_strategy=tf.distribute.get_strategy())
    batch = compat.first_batch(iterator)
    np.testing.assert_array_equal(np.asarray(keras.tree.flatten(batch)[0]), x[:4])


def test_variable_on_read_is_sync_on_read_under_a_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        v = compat.variable(
            tf.zeros([2]),
            synchronization="on_read",
            aggregation="sum",
            trainable=False,
            autocast=False,
            name="on_read",
        )
    assert v.value.synchronization == tf.VariableSynchronization.ON_READ
    assert isinstance(v, keras.Variable)


def test_direct_merge_calls_restores_the_strategy():
    extended = tf.distribute.MirroredStrategy(["/cpu:0"]).extended
    before = extended._use_merge_call()
    with compat.direct_merge_calls(_StrategyOf(extended)):
        assert extended._use_merge_call() is False
    assert extended._use_merge_call() == before
    assert "_use_merge_call" not in vars(extended)


class _StrategyOf:
    def __init__(self, extended):
        self.extended = extended


def test_keras_version_is_supported():
    assert compat.KERAS_VERSION >= compat.MIN_KERAS_VERSION


# ----------------------------------------------------------- the one seam
_PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def _package_sources():
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if p not in COMPAT_FILES)


def _private_imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name.startswith(_PRIVATE_MODULES):
                yield node.lineno, name


def test_only_the_compat_module_imports_private_modules():
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {name}"
        for path in _package_sources()
        for line, name in _private_imports(ast.parse(path.read_text()))
    ]
    assert not found, (
        "Only keras_fastgrad/_compat/ may import `keras.src` or "
        f"`tensorflow.python`. Received imports in: {found}. Fix: add a "
        "named function or alias to `keras_fastgrad/_compat/` and call that."
    )


def _own_private_names(trees):
    """The `_`-prefixed names the package defines itself: functions,
    classes, methods, module and class variables, and attributes it assigns
    (`obj._x = ...`)."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {n for n in own if n.startswith("_")}


# Documented API of Python's own types, not private to anyone.
_PUBLIC_UNDERSCORE = {"_replace", "_fields", "_asdict", "_make"}


def _is_private(name):
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name not in _PUBLIC_UNDERSCORE


def foreign_private_uses(tree, own):
    """`(line, name)` of every private attribute `tree` reads that the
    package does not define (Keras' or TensorFlow's), directly
    (`layer._inbound_nodes`) or by name (`getattr(layer, "_x")`)."""
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
        if name and _is_private(name) and name not in own:
            yield node.lineno, name


def test_the_private_use_finder_finds_planted_uses():
    planted = ast.parse(
        "def f(layer, model):\n"
        "    model._own = 1\n"
        "    a = layer._inbound_nodes[0]\n"
        "    b = getattr(model, '_nodes_by_depth')\n"
        "    return model._own, layer.__class__\n"
    )
    own = _own_private_names([planted])
    assert sorted(name for _, name in foreign_private_uses(planted, own)) == [
        "_inbound_nodes",
        "_nodes_by_depth",
    ]


def test_only_the_compat_module_reads_private_keras_attributes():
    # Scans the source itself, not a list of names known to be private: a
    # new private read anywhere but `_compat/` fails here.
    sources = {path: ast.parse(path.read_text()) for path in PACKAGE_DIR.rglob("*.py")}
    own = _own_private_names(tree for path, tree in sources.items() if path not in COMPAT_FILES) | {
        name for _, name, _ in compat.OVERRIDDEN_PRIVATE_METHODS
    }
    # (Names `_compat/` alone defines are its private helpers, not ours
    # to read elsewhere either: they count as foreign outside it.)
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {name}"
        for path, tree in sources.items()
        if path not in COMPAT_FILES
        for line, name in foreign_private_uses(tree, own)
    ]
    assert not found, (
        "Private Keras/TF attributes must be used through "
        f"keras_fastgrad/_compat/. Received uses in: {found}. Fix: add a "
        "named function to `_compat/` (and its name to `PRIVATE_NAMES`)."
    )


def _is_framework(cls):
    return cls.__module__.split(".")[0] in ("keras", "tensorflow")


def _keras_derived_classes():
    import inspect as _inspect

    seen, found = set(), []
    for path in PACKAGE_DIR.rglob("*.py"):
        module_name = (
            ".".join(("keras_fastgrad",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts)
            .removesuffix(".__init__")
            .removesuffix(".__main__")
        )
        if module_name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # The JAX step's modules where JAX is not installed (the README's
            # venv, the oldest versions'): only ever imported under
            # KERAS_BACKEND=jax.
            jax_only = ("keras_fastgrad.backend.jax", "keras_fastgrad.profiling._jax")
            if module_name.startswith(jax_only) and (error.name or "").startswith("jax"):
                continue
            raise
        for _, cls in _inspect.getmembers(module, _inspect.isclass):
            if cls.__module__.startswith("keras_fastgrad") and cls not in seen:
                seen.add(cls)
                in_compat = cls.__module__.startswith(compat.__name__)
                if not in_compat and any(map(_is_framework, cls.__mro__)):
                    found.append(cls)
    return found


def test_private_methods_that_shadow_keras_are_declared_overrides():
    # A method named like one of Keras' own private members replaces it
    # silently: only the declared overrides may.
    declared = {name for _, name, _ in compat.OVERRIDDEN_PRIVATE_METHODS}
    found = []
    for cls in _keras_derived_classes():
        bases = [b for b in cls.__mro__ if _is_framework(b)]
        # The class's own names, and its mixins' (`models.training_hooks`).
        own = [b for b in cls.__mro__ if not _is_framework(b) and b is not object]
        for name in {n for b in own for n in vars(b)}:
            if (
                _is_private(name)
                and name not in declared
                and not name.startswith("_abc")
                and any(name in vars(b) for b in bases)
            ):
                found.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert not found, (
        f"These override Keras' private members without being declared: {found}. "
        "Fix: rename ours, or list the override in `_compat.OVERRIDDEN_PRIVATE_METHODS`."
    )


# ------------------------------------------------------- version branches
def test_a_strategy_refused_before_keras_3_10(monkeypatch):
    from types import SimpleNamespace

    import tensorflow as tf

    from keras_fastgrad.step import trainer as _validation

    class MirroredStrategy(SimpleNamespace):
        pass

    two = MirroredStrategy(num_replicas_in_sync=2)
    one = MirroredStrategy(num_replicas_in_sync=1)  # one GPU, or none
    monkeypatch.setattr(compat, "MULTI_REPLICA_SUPPORTED", False)
    for strategy, count in ((two, 2), (one, 1)):
        with pytest.raises(
            ValueError,
            match=r"needs Keras >= 3\.10.*Received: keras==.*`MirroredStrategy` "
            rf"with {count} replica\(s\)\. Fix: `pip install \"keras>=3\.10\"`",
        ):
            _validation.check_keras_supports_replicas(strategy)
    _validation.check_keras_supports_replicas(tf.distribute.get_strategy())  # none
    monkeypatch.setattr(compat, "MULTI_REPLICA_SUPPORTED", True)
    _validation.check_keras_supports_replicas(two)
    _validation.check_keras_supports_replicas(one)


_TWO_REPLICAS_SCRIPT = """
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import keras_fastgrad
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
try:
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
except ValueError as e:
    print(e)
"""


@pytest.mark.slow  # a fresh process
@pytest.mark.skipif(compat.MULTI_REPLICA_SUPPORTED, reason="only Keras < 3.10 refuses replicas")
def test_fit_on_two_replicas_raises_the_clear_error_on_old_keras():
    # Two logical CPUs must be configured before TensorFlow initialises.
    root = str(PACKAGE_DIR.parent)
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _TWO_REPLICAS_SCRIPT],
        env=dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs Keras >= 3.10" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_batch_end_index_is_the_calls_last_batch(steps_per_execution):
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(compat.last_batch(self.model, batch))

    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    model.fit(np.ones((6, 3)), np.ones((6, 1)), batch_size=1, verbose=0, callbacks=[Record()])
    assert seen == list(range(steps_per_execution - 1, 6, steps_per_execution))


def test_batch_spec_reads_fits_epoch_iterator_without_iterating():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    class Counting(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.epoch_ends = 0

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.ones((4, 2), "float32"), np.ones((4,), "int32")

        def on_epoch_end(self):
            self.epoch_ends += 1

    dataset = Counting()
    iterator = TFEpochIterator(x=dataset, distribute_strategy=tf.distribute.get_strategy())
    x_spec, y_spec = compat.batch_spec(iterator)
    assert (x_spec.shape.as_list(), x_spec.dtype) == ([None, 2], tf.float32)
    assert (y_spec.shape.as_list(), y_spec.dtype) == ([None], tf.int32)
    assert dataset.epoch_ends == 0


# ------------------------------------------------- one module per library
def _module_level_names(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("library", ["keras", "tensorflow", "jax"])
def test_every_name_of_a_bridge_is_reexported(library):
    missing = sorted(
        name
        for name in _module_level_names(COMPAT_DIR / f"{library}.py")
        if getattr(compat, name, None)
        is not getattr(importlib.import_module(f"keras_fastgrad._compat.{library}"), name)
    )
    assert not missing, f"`keras_fastgrad._compat` does not re-export {missing} of {library}.py"


def test_the_keras_and_jax_bridges_import_no_backend():
    for library in ("keras", "jax"):
        tree = ast.parse((COMPAT_DIR / f"{library}.py").read_text())
        imported = {
            alias.name if isinstance(node, ast.Import) else node.module
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        backends = {
            m
            for m in imported
            if m.split(".")[0] in ("tensorflow", "jax") or m == "keras_fastgrad._tf_startup"
        }
        assert not backends, f"_compat/{library}.py imports {backends}"


def test_private_names_are_every_bridges():
    assert compat.PRIVATE_NAMES == compat.KERAS_PRIVATE_NAMES + compat.TENSORFLOW_PRIVATE_NAMES
    assert ("keras.layers.BatchNormalization", "_moments") in compat.PRIVATE_NAMES


def test_the_batchnorm_recorder_is_still_reached_through_compat():
    from keras_fastgrad.step import batchnorm_recording

    assert compat.batchnorm_recording is batchnorm_recording.batchnorm_recording
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        compat.nothing_here  # noqa: B018
