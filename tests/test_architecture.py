"""The package's shape, checked: no import cycles (function-level imports
count too: they only hide a cycle), and tests, benchmarks and notebooks
use the models' public surface, not the step's private `_fg_*` names."""

import ast
import pathlib

import keras_fastgrad

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
            t for t in targets
            if t in modules and t != name and not path.name == "__init__.py"
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


def test_the_step_reads_its_state_from_one_object():
    # The step's units get `StepState` as an argument; the model keeps no
    # step state in attributes of its own.
    model_source = (PACKAGE_DIR / "models" / "model.py").read_text()
    assigned = {
        node.attr
        for node in ast.walk(ast.parse(model_source))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
        and node.attr.startswith("_fg_")
    }
    assert not assigned, f"model.py sets step state on the model: {sorted(assigned)}"


def test_tests_benchmarks_and_notebooks_use_no_private_step_names():
    found = []
    paths = [
        p for folder in ("tests", "benchmarks", "notebooks", "tools")
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


# The layers of the package, bottom up: a module may import its own layer
# and those below, never one above (the step does not know the models that
# run it; callbacks read what the step measured).
LAYERS = [
    {"keras_fastgrad._compat", "keras_fastgrad._validation"},
    {"keras_fastgrad.aggregators", "keras_fastgrad.step", "keras_fastgrad.multitask"},
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
