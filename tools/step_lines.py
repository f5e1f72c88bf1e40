"""How much of the step's code is backend-neutral: code lines (docstrings,
comments and blank lines out) of the step's modules, by the backend each
module imports.

    python tools/step_lines.py [--files]

The step's modules: `keras_fastgrad/step/`, `keras_fastgrad/maths/`,
`keras_fastgrad/backend/` (both shells), `keras_fastgrad/multitask/` and
`keras_fastgrad/aggregators/` (the multi-task merge). A module imports
TensorFlow when any of its import statements (top-level or in a function)
names `tensorflow`, `keras_fastgrad._tf_startup`, the TensorFlow shell
(`keras_fastgrad.backend.tensorflow`) or `keras_fastgrad._compat.tensorflow`;
JAX when one names `jax`, the JAX shell or `keras_fastgrad._compat.jax`;
neither makes it backend-neutral. Prints the share of each, the
lines of each shell (`backend/tensorflow/`, `backend/jax/`), and the stricter
share of backend-neutral code outside the shells' folders (a shell module
written only with `keras.ops` imports neither backend, yet only its shell
calls it).
"""

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_fastgrad"
STEP_FOLDERS = ("step", "maths", "backend", "multitask", "aggregators")
# A module that imports a shell (or a bridge to one library) runs on that
# backend alone: it counts as importing it.
TENSORFLOW = (
    "tensorflow",
    "keras_fastgrad._tf_startup",
    "keras_fastgrad.backend.tensorflow",
    "keras_fastgrad._compat.tensorflow",
)
JAX = ("jax", "keras_fastgrad.backend.jax", "keras_fastgrad._compat.jax")


def code_lines(source):
    """The number of lines holding code: not blank, not only a comment, not
    part of a module, class or function docstring."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def imported(source):
    """Every module name an import statement of `source` names."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _names(modules, roots):
    return any(m == r or m.startswith(r + ".") for m in modules for r in roots)


def backend_of(source):
    """`"tensorflow"`, `"jax"`, `"both"` or `"neither"`: what the module imports."""
    modules = imported(source)
    tf, jax = _names(modules, TENSORFLOW), _names(modules, JAX)
    return {(True, True): "both", (True, False): "tensorflow", (False, True): "jax"}.get(
        (tf, jax), "neither"
    )


def step_modules():
    """The step's module paths, sorted."""
    return sorted(p for folder in STEP_FOLDERS for p in (PACKAGE / folder).rglob("*.py"))


def count():
    """`(rows, totals)`: `rows` a list of `(path, backend, lines)`, `totals`
    the lines by backend."""
    rows, totals = [], {"neither": 0, "tensorflow": 0, "jax": 0, "both": 0}
    for path in step_modules():
        source = path.read_text()
        kind, lines = backend_of(source), code_lines(source)
        rows.append((path.relative_to(ROOT).as_posix(), kind, lines))
        totals[kind] += lines
    return rows, totals


def shell_lines(rows, shell):
    """Code lines under `keras_fastgrad/backend/<shell>/`."""
    prefix = f"keras_fastgrad/backend/{shell}/"
    return sum(lines for path, _, lines in rows if path.startswith(prefix))


def neutral_outside_shells(rows):
    """Backend-neutral code lines that are not under a shell's folder."""
    shells = tuple(f"keras_fastgrad/backend/{shell}/" for shell in ("tensorflow", "jax"))
    return sum(
        lines for path, kind, lines in rows if kind == "neither" and not path.startswith(shells)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="print every module's row")
    args = parser.parse_args(argv)
    rows, totals = count()
    if args.files:
        for path, kind, lines in rows:
            print(f"{lines:5d}  {kind:10s}  {path}")
    total = sum(totals.values())
    for kind in ("neither", "tensorflow", "jax", "both"):
        print(f"{kind:10s} {totals[kind]:5d} lines  {totals[kind] / total:6.1%}")
    print(f"{'total':10s} {total:5d} lines")
    print(f"backend-neutral share: {totals['neither'] / total:.1%}")
    outside = neutral_outside_shells(rows)
    print(f"backend-neutral outside the shells' folders: {outside} lines, {outside / total:.1%}")
    for shell in ("tensorflow", "jax"):
        print(f"shell backend/{shell}/: {shell_lines(rows, shell)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
