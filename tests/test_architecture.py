"""The package's shape, checked: no import cycles (function-level imports
count too: they only hide a cycle), and tests, benchmarks and notebooks
use the models' public surface, not the step's private `_fg_*` names."""

import ast
import pathlib

import pytest

import keras_fastgrad

pytestmark = pytest.mark.tensorflow_only(
    reason="the package's shape, checked once (in the TensorFlow run)"
)

PACKAGE_DIR = pathlib.Path(keras_fastgrad.__file__).parent
REPO = PACKAGE_DIR.parent


def _module_name(path):
    parts = ("keras_fastgrad",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """`{module: {modules it imports}}` over the package's modules, every
    import statement counted (top-level or inside a function)."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative import
                    package = name.split(".")[: len(name.split(".")) - node.level]
                    base = ".".join(package + [node.module])
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        # A package's `__init__` re-exports its modules: importing the
        # package is not a dependency on every module it names.
        graph[name] = {
            t
            for t in targets
            if t in modules
            and t != name
            and not path.name == "__init__.py"
            and t not in ("keras_fastgrad", "keras_fastgrad.callbacks")
        }
    return graph


def _cycles(graph):
    """The strongly connected components with more than one module
    (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    cycles = _cycles(_import_graph())
    assert not cycles, (
        "Modules of keras_fastgrad import each other (directly or through "
        f"others, function-level imports included): {cycles}. Fix: move "
        "what both need into a module of its own."
    )


# What the package may set on a model, besides the options (plain
# attributes, part of the config) and Keras' own `train_function`: each with
# why. Everything else the step keeps lives in `model.fastgrad_step_state`.
MODEL_ATTRIBUTES = {
    "fastgrad_step_state": "the step's one state object (its own saved entry)",
    "__class__": "the functional variant, `fastgrad`, and the callbacks' attachment",
    "train_function": "Keras' own: reset so the step is traced again",
    "compiled": "Keras' own: False after a refused `compile`, so `fit` asks for one that passes",
    "make_train_function": "the callbacks' attachment on a plain model (never saved)",
    "_fg_attachment": "the callbacks' attachment on a plain model (never saved)",
    "_fg_cloned_options": "a clone's options, from `__new__` to `__init__` (popped there)",
    "_loss_tracker": "Keras' own `loss` metric, replaced by one that reports NaN periods",
    "_losses_override": "Keras' own (`Layer.losses` reads it): the losses of a JAX stateless "
    "forward, set around a `compute_loss` override and restored (`_compat.forward_losses`)",
    "train_step": "JAX: a new function for Keras to jit while it makes the train function "
    "(removed right after; `jax.jit` would reuse the bound method's old trace)",
}
_MODEL_NAMES = ("model", "instance")


def _is_model_class(node):
    names = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
    return any(n.endswith(("Model", "Sequential")) for n in names)


def _attributes_set_on_models(tree):
    """`(line, name)` of every attribute `tree` sets on a model: `model.x =`
    anywhere, `self.x =` in a model class, `setattr` / `object.__setattr__`
    / `vars(model)[...]` with a literal name."""
    model_classes = [
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _is_model_class(n)
    ]
    in_model_class = {id(n) for c in model_classes for n in ast.walk(c)}
    for node in ast.walk(tree):
        target = name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            func = ast.unparse(node.func)
            if func in ("setattr", "delattr", "object.__setattr__", "object.__delattr__"):
                target, name = node.args[0], node.args[1].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "vars":
                if isinstance(node.slice, ast.Constant):
                    target, name = node.value.args[0], node.slice.value
        if not isinstance(target, ast.Name):
            continue
        if target.id in _MODEL_NAMES or (target.id == "self" and id(node) in in_model_class):
            yield node.lineno, name


def test_the_finder_of_model_attributes_finds_planted_ones():
    planted = ast.parse(
        "class M(keras.Model):\n"
        "    def f(self):\n"
        "        self._fg_window = 1\n"
        "def g(model, other):\n"
        "    model.streak = 0\n"
        "    object.__setattr__(model, '_fg_x', 1)\n"
        "    vars(model)['_fg_y'] = 2\n"
        "    other.z = 3\n"
    )
    assert sorted(n for _, n in _attributes_set_on_models(planted)) == [
        "_fg_window",
        "_fg_x",
        "_fg_y",
        "streak",
    ]


def test_the_step_reads_its_state_from_one_object():
    # Every module of the package: the models keep no step state in
    # attributes of their own, only the options and `fastgrad_step_state`.
    from keras_fastgrad.models.model import OPTION_NAMES

    allowed = set(MODEL_ATTRIBUTES) | set(OPTION_NAMES)
    found = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for line, name in _attributes_set_on_models(ast.parse(path.read_text()))
        if name not in allowed
    ]
    assert not found, (
        f"The package sets step state on models: {found}. Fix: keep it in "
        "`StepState` (`model.fastgrad_step_state`), or add the attribute to "
        "MODEL_ATTRIBUTES with why."
    )


def test_tests_benchmarks_and_notebooks_use_no_private_step_names():
    found = []
    paths = [
        p
        for folder in ("tests", "benchmarks", "notebooks", "tools")
        for p in (REPO / folder).rglob("*")
        if p.suffix in (".py", ".ipynb") and p.name != "test_architecture.py"
    ]
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "._fg_" in line:
                found.append(f"{path.relative_to(REPO)}:{number}")
    assert not found, (
        "Tests, benchmarks and notebooks must read what the step measured "
        "through the model's public surface (`fastgrad_step_state`, "
        f"`telemetry_counters()`, ...). Received `._fg_` in: {found}"
    )


# The layers of the package, bottom up (`maths`: the units' maths in
# `keras.ops`, written once for both backends' steps): a module may import its own layer
# and those below, never one above (the step does not know the models that
# run it; callbacks read what the step measured). `multitask` sits above the
# step: it builds on the step's units (replicas, finite check, telemetry
# keys) and the step is handed its `TaskMerger` as an object (made by the
# model), computing the task losses itself (`step/task_losses.py`).
LAYERS = [
    {"keras_fastgrad._compat", "keras_fastgrad._tf_startup", "keras_fastgrad._validation"},
    {"keras_fastgrad.maths"},
    {"keras_fastgrad.aggregators"},
    {"keras_fastgrad.step"},
    {"keras_fastgrad.multitask", "keras_fastgrad.backend"},
    {"keras_fastgrad.models"},
    {"keras_fastgrad.callbacks", "keras_fastgrad.profiling"},
    {"keras_fastgrad", "keras_fastgrad.demo", "keras_fastgrad.profile"},
]


def _layer(module):
    for level, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names if n != "keras_fastgrad"):
            return level
    return len(LAYERS) - 1


def test_lower_layers_do_not_import_higher_ones():
    upward = [
        f"{module} -> {target}"
        for module, targets in _import_graph().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert not upward, (
        f"These imports run up the package's layers {LAYERS}: {upward}. Fix: "
        "move what the lower module needs down, or pass it in as an argument."
    )


def test_the_step_does_not_import_multitask():
    # Issue 29's seam: `multitask` builds on the step, never the reverse
    # (the step computes the task losses itself, `step/task_losses.py`).
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _import_graph().items()
        if module.startswith("keras_fastgrad.step")
        for target in targets
        if target.startswith("keras_fastgrad.multitask")
    )
    assert not upward, (
        f"The step imports `multitask`: {upward}. Fix: move what the step needs "
        "into `keras_fastgrad.step` (or `maths`), or hand it to the step as an object."
    )


def test_the_maths_is_backend_neutral_at_import():
    # `keras_fastgrad.maths` is written in `keras.ops` for every backend: a
    # backend's own fast path is imported inside its branch, never at the
    # top of a module (importing the maths must not import TensorFlow or JAX).
    found = []
    for path in sorted((PACKAGE_DIR / "maths").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(REPO)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in ("tensorflow", "jax", "torch")
            ]
    assert not found, (
        f"Backend imports at the top of `keras_fastgrad.maths`: {found}. Fix: "
        "write it in `keras.ops`, or import the backend inside the branch "
        "that needs its fast path (`if keras.backend.backend() == ...`)."
    )
