"""Runs a notebook's code cells top to bottom in one namespace, as a fresh
Jupyter kernel would, without Jupyter.

    python tools/run_notebook.py notebooks/01_quickstart.ipynb

The `.ipynb` file is read as JSON (nbformat 4): every code cell is compiled
and executed in order in one shared namespace; when a cell ends with an
expression, its value is printed as Jupyter would display it. matplotlib
uses the non-interactive Agg backend and figures are closed after each
cell (set `NOTEBOOK_FIGURES` to a folder to save them there as PNGs
first, to look at them). The working directory is the notebook's folder.

Set `KFG_EXECUTED_NOTEBOOKS` to a folder to also write the executed
notebook there, under the same name: each code cell with its output (what
it printed, and its figures as PNGs), as Jupyter would store it. The
documentation site renders those copies (`tools/mkdocs_hooks.py`), so the
notebooks run once per CI run, for the tests and the site alike.

Exit status 0 when every cell ran. Otherwise the index and source of the
failing cell and the traceback go to stderr and the exit status is 1.
IPython magics and shell escapes (`%...`, `!...`) are refused: the
notebooks stay plain Python, runnable by this script and by Jupyter alike.
"""

import ast
import base64
import io
import json
import os
import sys
import time
import traceback


def code_cells(path):
    """`[(index, source)]` of the notebook's code cells (index in all cells)."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    cells = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = cell["source"]
        cells.append((index, "".join(source) if isinstance(source, list) else source))
    return cells


def check_plain_python(index, source):
    for line in source.splitlines():
        if line.lstrip().startswith(("%", "!")):
            raise SyntaxError(
                f"Cell {index} uses an IPython magic or shell escape: "
                f"{line.strip()!r}. The notebooks must be plain Python."
            )


def run_cell(index, source, namespace, filename):
    """Executes one cell; prints the value of a final expression."""
    check_plain_python(index, source)
    tree = ast.parse(source, filename=f"<{filename} cell {index}>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, f"<{filename} cell {index}>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, f"<{filename} cell {index}>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def save_figures(plt, folder, name, index):
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(name)[0]
    for number in plt.get_fignums():
        plt.figure(number).savefig(
            os.path.join(folder, f"{stem}_cell{index}_fig{number}.png"), dpi=80
        )


class Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy (a cell's printed output)."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def figure_outputs(plt):
    """The open figures as Jupyter `display_data` outputs (PNG)."""
    outputs = []
    for number in plt.get_fignums():
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", dpi=80, bbox_inches="tight")
        outputs.append(
            {
                "output_type": "display_data",
                "data": {
                    "image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                    "text/plain": [f"<Figure {number}>"],
                },
                "metadata": {},
            }
        )
    return outputs


def write_executed(path, outputs, folder):
    """Writes the notebook at `path` with `outputs` (`{cell index: [...]}`)."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    count = 0
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = outputs.get(index, [])
    notebook["metadata"].setdefault(
        "kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"}
    )
    notebook["metadata"].setdefault("language_info", {"name": "python"})
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, os.path.basename(path))
    with open(target, "w", encoding="utf-8") as f:
        json.dump(notebook, f, indent=1)
        f.write("\n")
    return target


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python tools/run_notebook.py NOTEBOOK.ipynb", file=sys.stderr)
        return 2
    path = os.path.abspath(argv[0])
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = os.environ.get("NOTEBOOK_FIGURES")
    figures = os.path.abspath(figures) if figures else None
    executed = os.environ.get("KFG_EXECUTED_NOTEBOOKS")
    executed = os.path.abspath(executed) if executed else None
    outputs = {}
    os.chdir(os.path.dirname(path))
    name = os.path.basename(path)
    namespace = {"__name__": "__main__"}
    start = time.perf_counter()
    for index, source in code_cells(path):
        print(f"--- cell {index}", flush=True)
        stdout, stderr = sys.stdout, sys.stderr
        if executed:
            sys.stdout, sys.stderr = Tee(stdout), Tee(stderr)
        try:
            run_cell(index, source, namespace, name)
        except BaseException:  # noqa: BLE001 - reported with the cell
            sys.stdout.flush()
            print(f"\n{name}: cell {index} failed. Its source:\n", file=sys.stderr)
            print(source, file=sys.stderr)
            print("\nTraceback:", file=sys.stderr)
            traceback.print_exc()
            return 1
        finally:
            if executed:
                cell_outputs = [
                    {"output_type": "stream", "name": stream_name, "text": "".join(tee.parts)}
                    for stream_name, tee in (("stdout", sys.stdout), ("stderr", sys.stderr))
                    if "".join(tee.parts)
                ]
                outputs[index] = cell_outputs + figure_outputs(plt)
                sys.stdout, sys.stderr = stdout, stderr
            if figures:
                save_figures(plt, figures, name, index)
            plt.close("all")
        sys.stdout.flush()
    if executed:
        write_executed(path, outputs, executed)
    print(f"--- {name}: all cells ran in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
