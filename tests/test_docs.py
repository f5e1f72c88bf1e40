"""The documentation holds true: docstrings in Keras style, and every code
block on the site runs as shown.

**Docstrings.** Public: the classes and functions exported by
`keras_fastgrad` and `keras_fastgrad.callbacks` (their `__all__`) and
defined in `keras_fastgrad.aggregators` (names without a leading
underscore). Each docstring needs

- a summary line: one sentence on the first line, ending with a period;
- an `Args:` section naming every argument, where the object takes any
  (a class: its `__init__`; `*args` / `**kwargs` are not required; a
  dataclass may document its fields under `Attributes:`);
- an `Example` section with `>>>` lines. The examples run as doctests in the
  same `python -m pytest` run (`--doctest-modules` in pyproject.toml).

Gaps known when this test was written are listed in `KNOWN_GAPS`, so the
list is visible and does not grow; a fixed gap must be removed from it.

**Code blocks.** Every fenced block of the site's Markdown pages (`docs/`,
and the pages the site shows from elsewhere: `CHANGELOG.md`,
`benchmarks/RESULTS.md`) names its language. The `python` blocks of a page
run in order, in one namespace (as a notebook's cells), in a fresh working
directory: each page defines the data it uses, visibly. A block that
cannot run says so on the line before it, `<!-- not run: <why> -->`; the
blocks in another language (shell commands, text, JSON) are not run
either. Each block not run is reported as a skipped test,
`test_code_block_not_run[<page>:<line> <language>]`, with the reason, so
`pytest -rs` lists them and the summary counts them: the runs pass, the
rest skip. (API pages' examples are the docstrings' doctests; the notebooks
run in tests/test_notebooks.py.)
"""

import dataclasses
import inspect
import os
import re

import pytest

import keras_fastgrad
from keras_fastgrad import aggregators, callbacks

pytestmark = pytest.mark.tensorflow_only(
    reason="the pages' code on TensorFlow (on JAX: tests/test_docs_jax.py)"
)

# name -> the gaps it had when this test landed ("summary", "args",
# "example", "arg:<name>"). Fix the docstring, then delete the entry.
KNOWN_GAPS = {}

SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|"
    r"References|Note|Notes|Call arguments|Input shape|Output shape)"
    r"\s*:?\s*$"
)


def public_objects():
    found = {}
    for module in (keras_fastgrad, callbacks):
        for name in module.__all__:
            found[f"{module.__name__}.{name}"] = getattr(module, name)
    for name, value in vars(aggregators).items():
        if not name.startswith("_"):
            found[f"{aggregators.__name__}.{name}"] = value
    return {
        name: obj
        for name, obj in sorted(found.items())
        if (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__.startswith("keras_fastgrad")
    }


OBJECTS = public_objects()


def argument_names(obj):
    """Named arguments a caller passes (no `self`, `*args`, `**kwargs`)."""
    function = obj.__init__ if inspect.isclass(obj) else obj
    if function is object.__init__:
        return []
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj) if f.init]
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin's slot wrapper
        return []
    return [
        p.name
        for p in parameters
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def section(doc, headers):
    """The lines of the first section titled by one of `headers`, or None."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().rstrip(":") in headers and line.strip().endswith(":"):
            body = []
            for following in lines[i + 1 :]:
                if SECTION.match(following.strip()) and not following.startswith(" "):
                    break
                body.append(following)
            return body
    return None


def documented_names(body):
    """Argument names at the first indentation level of an Args section."""
    entries = [line for line in body if line.strip()]
    if not entries:
        return set()
    indent = min(len(line) - len(line.lstrip()) for line in entries)
    names = set()
    for line in entries:
        if len(line) - len(line.lstrip()) != indent:
            continue
        head = re.match(r"([\w*][\w*, ]*?)\s*(\([^)]*\))?\s*:", line.strip())
        if head:
            names.update(n.strip().lstrip("*") for n in head.group(1).split(","))
    return names


def docstring_gaps(obj):
    doc = inspect.getdoc(obj) or ""
    gaps = set()
    first = doc.splitlines()[0].strip() if doc else ""
    if not first or not first.endswith("."):
        gaps.add("summary")
    arguments = argument_names(obj)
    if arguments:
        headers = ("Args", "Arguments")
        if dataclasses.is_dataclass(obj):
            headers += ("Attributes",)
        body = section(doc, headers)
        if body is None:
            gaps.add("args")
        else:
            documented = documented_names(body)
            gaps.update(f"arg:{a}" for a in arguments if a not in documented)
    example = section(doc, ("Example", "Examples"))
    if example is None or not any(line.strip().startswith(">>>") for line in example):
        gaps.add("example")
    return gaps


def test_the_public_api_is_found():
    expected = {
        "keras_fastgrad.FastGradModel",
        "keras_fastgrad.profile_step",
        "keras_fastgrad.callbacks.GradientNormLogger",
        "keras_fastgrad.callbacks.NonFiniteGuard",
        "keras_fastgrad.callbacks.TapeVariableCounter",
        "keras_fastgrad.callbacks.RetraceWatch",
        "keras_fastgrad.aggregators.PCGrad",
        "keras_fastgrad.aggregators.MGDA",
    }
    assert expected <= set(OBJECTS)


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_public_docstring_is_keras_style(name):
    gaps = docstring_gaps(OBJECTS[name])
    new = gaps - KNOWN_GAPS.get(name, set())
    assert not new, (
        f"{name}: docstring lacks {sorted(new)}. Keras style: a one-line "
        "summary ending with a period; `Args:` with one `name: ...` entry "
        "per argument; an `Example:` section with `>>>` lines (run as "
        "doctests)."
    )


def test_known_gaps_are_still_gaps():
    fixed = {
        name: sorted(gaps - docstring_gaps(OBJECTS[name]))
        for name, gaps in KNOWN_GAPS.items()
        if name in OBJECTS and gaps - docstring_gaps(OBJECTS[name])
    }
    gone = sorted(name for name in KNOWN_GAPS if name not in OBJECTS)
    assert not fixed and not gone, (
        f"Fixed docstrings: delete these from KNOWN_GAPS in tests/test_docs.py: "
        f"{fixed}; no longer public: {gone}"
    )


def test_the_checker_sees_missing_sections():
    def documented(alpha, beta=1):
        """Adds.

        Args:
            alpha: A number.
            beta: Another, defaults to `1`.

        Example:

        >>> documented(1)
        2
        """

    def undocumented(alpha, beta=1):
        """adds"""

    def half(alpha, beta=1):
        """Adds.

        Args:
            alpha, gamma: Numbers.

        Example:
            Call it.
        """

    assert docstring_gaps(documented) == set()
    assert docstring_gaps(undocumented) == {"summary", "args", "example"}
    assert docstring_gaps(half) == {"arg:beta", "example"}


def test_docstrings_that_list_options_and_aggregators_list_them_all():
    # Lists in prose go stale when an option or a method is added: these
    # are checked against the registries they describe.
    from keras_fastgrad import aggregators
    from keras_fastgrad.models.model import OPTION_NAMES

    model_doc = keras_fastgrad.FastGradModel.__doc__
    missing = [n for n in aggregators.NAMES if f'`"{n}"`' not in model_doc]
    assert not missing, f"FastGradModel's docstring does not name the aggregators {missing}"
    for owner in (
        keras_fastgrad.FastGradModel,
        keras_fastgrad.FastGradSequential,
        keras_fastgrad.fastgrad,
    ):
        missing = [
            n
            for n in OPTION_NAMES
            if f"`{n}`" not in owner.__doc__ and f"    {n}:" not in owner.__doc__
        ]
        assert not missing, f"{owner.__name__}'s docstring does not name the options {missing}"


# --- The site's code blocks run as shown ----------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Markdown pages the site shows from elsewhere (tools/mkdocs_hooks.py).
EXTERNAL_PAGES = (
    "CHANGELOG.md",
    os.path.join("benchmarks", "RESULTS.md"),
    os.path.join("benchmarks", "RESULTS-large.md"),
)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<why>.+?)\s*-->\s*$")
# A block that needs a package beyond the page's install line (TensorFlow
# on a page read by JAX users too): `<!-- needs: tensorflow -->` on the line
# before it. It runs where the package is installed and is skipped, declared,
# elsewhere (the JAX venv has no TensorFlow); the page says so in words,
# shortly before the block (`test_a_block_that_needs_a_package_says_so`).
NEEDS = re.compile(r"^\s*<!--\s*needs:\s*(?P<modules>[\w, ]+?)\s*-->\s*$")
# A block that is a whole program run in processes of its own (several
# devices, set before the backend starts, or several processes):
# `<!-- script: backend=jax devices=8 -->` or `<!-- script: backend=jax
# devices=2 processes=2 -->` on the line before it. The page's in-process
# run leaves it out; `run_script` runs it as written, saved as `train.py`,
# with the environment the page's launch commands set (XLA's host device
# count; the process ids): tests/test_docs_jax.py on JAX,
# `test_script_block_runs` on TensorFlow.
SCRIPT = re.compile(r"^\s*<!--\s*script:\s*(?P<settings>(?:\w+=\w+\s*)+)-->\s*$")
# How a page names each package a block may need.
PACKAGE_NAMES = {"tensorflow": "TensorFlow", "matplotlib": "matplotlib", "keras_hub": "KerasHub"}
# Languages that are not Python, and what a block in them is.
OTHER_LANGUAGES = {
    "bash": "a shell command",
    "console": "a shell session",
    "text": "text",
    "json": "data",
    "yaml": "configuration",
    "toml": "configuration",
}


@dataclasses.dataclass
class CodeBlock:
    page: str  # relative to the repository
    line: int  # the opening fence's, 1-based
    language: str  # "" when the fence names none
    source: str
    not_run: str  # why it is not run ("" for a Python block that runs)
    needs: tuple = ()  # modules it needs beyond the page's install line (NEEDS)
    script: tuple = ()  # `(name, value)` settings of a whole program (SCRIPT)

    @property
    def missing(self):
        """The modules of `needs` not installed here."""
        import importlib.util

        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    @property
    def name(self):
        return f"{self.page}:{self.line} {self.language or '(no language)'}"


def site_pages():
    pages = []
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        pages += [
            os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".md")
        ]
    return sorted(pages) + list(EXTERNAL_PAGES)


def code_blocks(page):
    """The fenced code blocks of a Markdown page, in order."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening.group("indent"), opening.group("fence")
        # `python`, `{ .python ... }`, `python title="x.py"`: the first word.
        words = opening.group("info").strip("{}").replace(".", " ", 1).split()
        language = words[0].lower() if words else ""
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = NOT_RUN.match(previous)
        needs = NEEDS.match(previous)
        needs = tuple(m.strip() for m in needs.group("modules").split(",")) if needs else ()
        script = SCRIPT.match(previous)
        script = (
            tuple(tuple(w.split("=")) for w in script.group("settings").split()) if script else ()
        )
        if marker:
            not_run = marker.group("why")
        elif script:
            not_run = f"a program run in processes of its own ({dict(script)}): run_script"
        elif language == "python":
            not_run = ""
        else:
            not_run = OTHER_LANGUAGES.get(language, f"not Python ({language or 'no language'})")
        blocks.append(
            CodeBlock(page, i + 1, language, "\n".join(body) + "\n", not_run, needs, script)
        )
        i = j + 1
    return blocks


BLOCKS = [block for page in site_pages() for block in code_blocks(page)]
# Pages whose code, as shown, fails because of a library bug (not the page):
# the test expects the failure (strict), so the fix must remove the entry.
KNOWN_BUGS = {}
RUN_PAGES = [
    pytest.param(page, marks=pytest.mark.xfail(reason=KNOWN_BUGS[page], strict=True))
    if page in KNOWN_BUGS
    else page
    for page in sorted({b.page for b in BLOCKS if not b.not_run})
]


def test_the_code_block_reader(tmp_path):
    import textwrap

    page = textwrap.dedent("""\
        Text.

        ```python
        a = 1
        ```

        - In a list:

            ```python title="b.py"
            b = a + 1
            ```

        <!-- not run: a fragment -->
        ```python
        c = undefined
        ```

        ```bash
        ls
        ```
        ```
        plain
        ```
        """)
    path = tmp_path / "page.md"  # an absolute path: os.path.join(ROOT, path) is path
    path.write_text(page, encoding="utf-8")
    blocks = code_blocks(str(path))
    assert [(b.line, b.language, b.source, b.not_run) for b in blocks] == [
        (3, "python", "a = 1\n", ""),
        (9, "python", "b = a + 1\n", ""),
        (14, "python", "c = undefined\n", "a fragment"),
        (18, "bash", "ls\n", "a shell command"),
        (21, "", "plain\n", "not Python (no language)"),
    ]


def test_the_site_has_code_blocks_and_most_run():
    pages = {b.page for b in BLOCKS if not b.not_run}
    assert len(BLOCKS) > 20 and len(pages) > 8
    assert os.path.join("docs", "getting-started.md") in pages


def test_every_code_block_names_its_language():
    # A bare fence hides whether the block is code that should run.
    bare = [b.name for b in BLOCKS if not b.language]
    assert not bare, f"fenced blocks without a language (use `text` for plain text): {bare}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.not_run], ids=lambda b: b.name)
def test_code_block_not_run(block):
    pytest.skip(f"{block.name}: {block.not_run}")


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_code_runs(page, tmp_path, monkeypatch):
    """The page's Python blocks, in order, in one namespace, as shown."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for block in code_blocks(page):
        if block.not_run or block.missing:  # (missing: test_block_needs skips it, declared)
            continue
        code = compile(block.source, f"{page}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(
                f"The code block at {page}:{block.line} fails as shown "
                f"({type(error).__name__}: {error}). Its source:\n{block.source}"
            ) from error


SCRIPTS = [b for b in BLOCKS if b.script]


def run_script(block, tmp_path, timeout=300):
    """Runs a `script` block as written, saved as `train.py` in `tmp_path`:
    `processes` copies at once (default 1), each with `KERAS_BACKEND` set to
    `backend` and XLA's host device count to `devices` (default 1); with
    several processes, their addresses on 127.0.0.1 and ids: on JAX
    Keras' `KERAS_DISTRIBUTION_*` variables (`keras.distribution.initialize()`
    reads them), on TensorFlow `TF_CONFIG`. Fails with a process's output
    if any fails; returns their outputs."""
    import json
    import socket
    import subprocess
    import sys

    settings = dict(block.script)
    processes, devices = int(settings.get("processes", 1)), int(settings.get("devices", 1))
    (tmp_path / "train.py").write_text(block.source, encoding="utf-8")
    env = {
        **os.environ,
        "KERAS_BACKEND": settings["backend"],
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    addresses = []
    for _ in range(processes if processes > 1 else 0):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            addresses.append(f"127.0.0.1:{free.getsockname()[1]}")
    if addresses:
        env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = addresses[0]
        env["KERAS_DISTRIBUTION_NUM_PROCESSES"] = str(processes)

    def own(i):  # process `i`'s id: Keras' variable on JAX, `TF_CONFIG` on TensorFlow
        if not addresses:
            return env
        if settings["backend"] == "tensorflow":
            task = {"type": "worker", "index": i}
            return {
                **env,
                "TF_CONFIG": json.dumps({"cluster": {"worker": addresses}, "task": task}),
            }
        return {**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(i)}

    started = [
        subprocess.Popen(
            [sys.executable, "train.py"],
            env=own(i),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outputs = []
    try:
        for process in started:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    for i, (process, output) in enumerate(zip(started, outputs)):
        assert process.returncode == 0, (
            f"{block.name}, process {i} of {processes}, failed as shown:\n{output[-3000:]}"
        )
    return outputs


@pytest.mark.slow  # (two TensorFlow processes)
@pytest.mark.parametrize(
    "block",
    [b for b in SCRIPTS if dict(b.script)["backend"] == "tensorflow"],
    ids=lambda b: b.name,
)
def test_script_block_runs(block, tmp_path):
    outputs = run_script(block, tmp_path)
    assert "loss" in outputs[0]  # (the chief's progress log)


def test_script_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- script: backend=jax devices=2 processes=2 -->\n```python\nimport jax\n```\n",
        encoding="utf-8",
    )
    (block,) = code_blocks(str(page))
    assert block.script == (("backend", "jax"), ("devices", "2"), ("processes", "2"))
    assert block.not_run.startswith("a program run in processes of its own")


NEEDING = [b for b in BLOCKS if b.needs]


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            b,
            marks=pytest.mark.skipif(
                bool(b.missing), reason=f"needs {', '.join(b.missing)}, not installed here"
            ),
        )
        for b in NEEDING
    ],
    ids=lambda b: b.name,
)
def test_a_block_that_needs_a_package_says_so(block):
    """Where it runs (its packages installed), the page names what it needs
    in the 12 lines before the block."""
    assert not block.missing
    with open(os.path.join(ROOT, block.page), encoding="utf-8") as f:
        before = "\n".join(f.read().splitlines()[max(0, block.line - 14) : block.line - 1])
    unsaid = [m for m in block.needs if PACKAGE_NAMES.get(m, m) not in before]
    assert not unsaid, (
        f"{block.name} needs {unsaid} (its `<!-- needs: -->` marker) and the page "
        "does not say so before it. Fix: say in words what the block needs."
    )


def test_needs_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Needs TensorFlow:\n\n<!-- needs: tensorflow -->\n```python\nimport tensorflow\n```\n",
        encoding="utf-8",
    )
    (block,) = code_blocks(str(page))
    assert block.needs == ("tensorflow",) and block.not_run == ""


def options_table():
    """`{option: default}` of the options table in docs/getting-started.md."""
    with open(os.path.join(ROOT, "docs", "getting-started.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("## Options") :]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M)
    return {name: default for name, default in rows}


def test_the_options_table_lists_every_option_with_its_default():
    import ast

    from keras_fastgrad.models.model import _DEFAULT_OPTIONS, OPTION_NAMES

    table = options_table()
    assert sorted(table) == sorted(OPTION_NAMES), (
        "docs/getting-started.md's options table: missing "
        f"{sorted(set(OPTION_NAMES) - set(table))}, unknown {sorted(set(table) - set(OPTION_NAMES))}"
    )
    wrong = {
        name: (cell, _DEFAULT_OPTIONS[name])
        for name, cell in table.items()
        if ast.literal_eval(cell) != _DEFAULT_OPTIONS[name]
    }
    assert not wrong, f"defaults in the options table differ from the signature's: {wrong}"
