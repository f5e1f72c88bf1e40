"""The API pages (docs/api/*.md, rendered by mkdocstrings from the
docstrings) as a reader sees them: a long signature wraps, one parameter
per line, and no parameter table shows an empty Type column (our
Google-style `Args:` carry no annotations; the description says the type,
Keras-style).

Two checks read the configuration (every venv); one renders
`docs/api/models.md` with the site's mkdocstrings options and reads the
HTML (needs the `docs` extra; skipped, declared, without it). And the
public docstrings state `micro_batches` for both backends (no
`tf.while_loop`: on JAX the slices run in a `jax.lax.scan`)."""

import configparser
import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="the site's pages, checked once (in the TensorFlow run)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NEEDS_DOCS_EXTRA = pytest.mark.skipif(
    any(
        importlib.util.find_spec(name) is None
        for name in ("mkdocs", "mkdocstrings_handlers", "yaml")
    ),
    reason="needs the `docs` extra (docs/contributing.md, Development environment)",
)


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def mkdocstrings_options():
    """`{option: value}` (as written) of mkdocs.yml's mkdocstrings Python
    handler `options:` (the top-level ones; read without a YAML parser,
    which the README's venv lacks)."""
    text = read("mkdocs.yml")
    block = re.search(r"^( +)- mkdocstrings:\n(.*?)(?=^\1- |^\S)", text, re.M | re.S)
    assert block, "mkdocs.yml has no mkdocstrings plugin"
    options = re.search(r"^( +)options:\n((?:\1 +.*\n|\s*\n)*)", block.group(2), re.M)
    assert options, "mkdocs.yml's mkdocstrings plugin sets no options"
    lines = options.group(2).splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    found = {}
    for line in lines:
        match = re.match(r" {%d}(\w+):\s*([^#\n]*?)\s*(?:#.*)?$" % indent, line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_the_docs_extra_installs_what_formats_signatures():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    docs = config["options.extras_require"]["docs"].split()
    names = {re.split(r"[<>=!~\[ ]", requirement)[0].lower() for requirement in docs}
    assert names & {"ruff", "black"}, (
        "mkdocstrings formats a separate signature with Ruff or Black, and "
        f"without either prints it on one clipped line. Received: docs = {docs}"
    )
    formatter = "ruff" if "ruff" in names else "black"
    assert re.search(rf"^{formatter}==", read("constraints.txt"), re.M), (
        f"constraints.txt pins no {formatter}"
    )


def test_signatures_wrap_and_no_parameter_table_has_an_empty_type_column():
    options = mkdocstrings_options()
    assert options.get("separate_signature") == "true", options
    assert 60 <= int(options.get("line_length", "60")) <= 100, options
    # The table style shows a Type column, empty for every parameter
    # without an annotation: a list (or spaCy's layout) shows none.
    assert options.get("docstring_section_style") in ("list", "spacy"), options


def signature_and_parameters(page):
    """The plain text of each signature block and whether any table has a
    Type column, in a rendered API page."""
    signatures = [
        html.unescape(re.sub(r"<[^>]+>", "", block))
        for block in re.findall(
            r'<div class="doc-signature highlight"><pre>(.*?)</pre>', page, re.S
        )
    ]
    return signatures, "<th>Type</th>" in page


@NEEDS_DOCS_EXTRA
def test_the_models_page_wraps_the_signature_one_parameter_per_line(tmp_path):
    import yaml

    # The site's own mkdocstrings options, on a site of one page.
    site = yaml.safe_load(read("mkdocs.yml"))
    plugin = next(p["mkdocstrings"] for p in site["plugins"] if "mkdocstrings" in p)
    python = plugin["handlers"]["python"]
    python["paths"] = [ROOT]
    python["options"]["extensions"] = [
        os.path.join(ROOT, extension) for extension in python["options"].get("extensions", [])
    ]
    docs = tmp_path / "docs"
    (docs / "api").mkdir(parents=True)
    (docs / "api" / "models.md").write_text(read("docs/api/models.md"))
    config = {
        "site_name": "api",
        "docs_dir": str(docs),
        "theme": {"name": site["theme"]["name"]},
        "markdown_extensions": ["toc", "pymdownx.highlight", "pymdownx.superfences"],
        "plugins": [{"mkdocstrings": plugin}],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "-f", "mkdocs.yml", "-d", "site"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "requires either Black or Ruff" not in build.stderr, build.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "models" / "index.html").read_text()
    signatures, type_column = signature_and_parameters(page)
    model = next(s for s in signatures if s.startswith("FastGradModel("))
    lines = model.strip().splitlines()
    assert lines[0] == "FastGradModel(" and lines[-1] == ")", model
    assert "    accumulation_steps=1," in lines and "    micro_batches=1," in lines, model
    assert all(len(line) <= 100 for line in lines), model
    assert not type_column


def public_docstrings():
    """`{name: docstring}` of the public classes and functions (with their
    public methods) of `keras_fastgrad` and `keras_fastgrad.callbacks`."""
    import keras_fastgrad
    from keras_fastgrad import callbacks

    found = {}
    for module in (keras_fastgrad, callbacks):
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj):
                continue
            found[name] = inspect.getdoc(obj) or ""
            for attribute, member in vars(obj).items() if inspect.isclass(obj) else ():
                if not attribute.startswith("_") and callable(member):
                    found[f"{name}.{attribute}"] = inspect.getdoc(member) or ""
    return found


def test_micro_batches_is_documented_for_both_backends():
    # The slices run in a `tf.while_loop` on TensorFlow and in a `jax.lax.scan`
    # per slice size on JAX: the public contract names neither.
    docs = public_docstrings()
    assert {"FastGradModel", "NonFiniteGuard", "GradientNoiseScale"} <= set(docs)
    naming = sorted(name for name, doc in docs.items() if "tf.while_loop" in doc)
    assert not naming, f"public docstrings naming `tf.while_loop`: {naming}"
    micro_batches = re.search(
        r"^ +micro_batches: (.*?)(?=^ +\w+: )", docs["FastGradModel"], re.M | re.S
    )
    assert micro_batches and "one slice" in micro_batches.group(1), docs["FastGradModel"]
