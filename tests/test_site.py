"""The documentation site (`mkdocs.yml`, `docs/`) and the README stay true.

`mkdocs build --strict` (in `.ci/run`) fails on broken links and missing
references; these checks run in the ordinary test run, without MkDocs:

- every public name has an entry (`::: keras_fastgrad....`) in the API pages;
- every page in `mkdocs.yml`'s `nav` exists;
- relative links in the README and in `docs/` point at existing files;
- the README is a landing page: short, and each of its code blocks is also
  in the site;
- the aggregators page's scale table matches what the code computes.
"""

import importlib.util
import os
import re

import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import aggregators, callbacks

pytestmark = pytest.mark.tensorflow_only(reason="the site, checked once (in the TensorFlow run)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# Pages the site shows from elsewhere in the repository (tools/mkdocs_hooks.py).
EXTERNAL = {
    "changelog.md": "CHANGELOG.md",
    "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
    "benchmarks/RESULTS-large.md": "benchmarks/RESULTS-large.md",
    "benchmarks/results.png": "benchmarks/results.png",
    **{f"notebooks/{n}": f"notebooks/{n}" for n in os.listdir(os.path.join(ROOT, "notebooks"))},
}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A landing page of 150-250 lines, as optax's and torchjd's READMEs: the
# speed is the short table of run_all (issue 47: six rows, TensorFlow and
# JAX); every row lives on docs/benchmarks.md and docs/index.md. 280 before,
# with the two 17-row tables.
README_MAX_LINES = 250


# The `docs` extra: installed by docs/contributing.md's development
# environment, whose commands run this file (CI runs them as written); the
# README's venv has no MkDocs, and these tests skip there, declared.
NEEDS_DOCS_EXTRA = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("griffe") is None,
    reason="needs the `docs` extra (docs/contributing.md, Development environment)",
)


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def docs_pages():
    pages = []
    for folder, _, names in os.walk(DOCS):
        pages += [
            os.path.relpath(os.path.join(folder, n), DOCS) for n in names if n.endswith(".md")
        ]
    return sorted(pages)


def public_names():
    names = {f"keras_fastgrad.{n}" for n in keras_fastgrad.__all__}
    names -= {"keras_fastgrad.callbacks", "keras_fastgrad.__version__"}
    names |= {f"keras_fastgrad.callbacks.{n}" for n in callbacks.__all__}
    names |= {f"keras_fastgrad.aggregators.{n}" for n in aggregators.__all__}
    return names


def api_entries():
    entries = set()
    for page in docs_pages():
        if page.startswith("api" + os.sep):
            entries |= set(re.findall(r"^::: (\S+)", read(os.path.join("docs", page)), re.M))
    return entries


def test_every_public_name_has_an_api_entry():
    required = {
        "keras_fastgrad.FastGradModel",
        "keras_fastgrad.FastGradSequential",
        "keras_fastgrad.fastgrad",
        "keras_fastgrad.profile_step",
        "keras_fastgrad.StepProfile",
        "keras_fastgrad.LOG_KEYS",
        "keras_fastgrad.aggregators.get",
        "keras_fastgrad.aggregators.serialize",
        "keras_fastgrad.aggregators.NAMES",
    }
    assert required <= public_names()
    missing = sorted(public_names() - api_entries())
    assert not missing, f"add `::: name` entries to docs/api/*.md for {missing}"


def test_api_entries_name_real_objects():
    for entry in api_entries():
        module, _, name = entry.rpartition(".")
        if entry == "keras_fastgrad.aggregators":
            continue
        assert hasattr(__import__(module, fromlist=[name]), name), entry


def nav_targets():
    return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.(?:md|ipynb))\s*$", read("mkdocs.yml"), re.M)


def test_every_nav_page_exists():
    targets = nav_targets()
    assert "index.md" in targets and len(targets) > 20
    missing = [
        t for t in targets if t not in EXTERNAL and not os.path.exists(os.path.join(DOCS, t))
    ]
    assert not missing, f"mkdocs.yml nav names missing pages: {missing}"
    pages = [p.replace(os.sep, "/") for p in docs_pages()]
    orphans = sorted(set(pages) - set(targets))
    assert not orphans, f"pages not in mkdocs.yml's nav: {orphans}"


def relative_links(text):
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        yield target.split("#")[0]


def test_readme_links_resolve():
    text = read("README.md")
    links = list(relative_links(text))
    assert any(link.startswith("docs/") for link in links), "the README links into the site"
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, f"README links to missing files: {missing}"
    anchors = re.findall(r"\]\(#([^)]+)\)", text)
    headings = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    assert set(anchors) <= headings, f"README anchors without a heading: {set(anchors) - headings}"


@pytest.mark.parametrize("page", docs_pages())
def test_docs_links_resolve(page):
    folder = os.path.dirname(page)
    missing = []
    for link in relative_links(read(os.path.join("docs", page))):
        target = os.path.normpath(os.path.join(folder, link)).replace(os.sep, "/")
        if target not in EXTERNAL and not os.path.exists(os.path.join(DOCS, target)):
            missing.append(link)
    assert not missing, f"docs/{page} links to missing files: {missing}"


def test_readme_is_a_landing_page_whose_examples_the_site_holds():
    text = read("README.md")
    assert len(text.splitlines()) <= README_MAX_LINES
    site = "\n".join(read(os.path.join("docs", p)) for p in docs_pages())
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    missing = [b for b in blocks if b not in site]
    assert not missing, f"README code blocks the site does not hold: {missing}"


def scale_table():
    rows = re.findall(r'^\| `"(\w+)"` \| `\w+` \| ([^|]+) \|', read("docs/aggregators.md"), re.M)
    return dict(rows)


@NEEDS_DOCS_EXTRA
def test_the_aggregators_scale_table_matches_the_code():
    import tensorflow as tf

    table = scale_table()
    assert sorted(table) == sorted(aggregators.NAMES)
    T = 3
    J = np.tile(np.array([[1.0, 2.0, 0.5]]), (T, 1))
    gram = tf.constant(J @ J.T)
    for name, cell in table.items():
        aggregator = aggregators.get(name)
        try:
            aggregator.build(T)  # GradVac's targets; the others have nothing to build
        except (AttributeError, TypeError):
            pass
        total = float(tf.reduce_sum(aggregator.weights(gram)))
        if cell.strip() == "`T g`":
            expected = T
        elif cell.strip() == "`g`":
            expected = 1.0
        else:  # CAGrad: (1 + c) / (1 + c^2)
            c = aggregator.c
            expected = (1 + c) / (1 + c**2)
            assert cell.startswith("`(1 + c) / (1 + c^2) g`")
        np.testing.assert_allclose(total, expected, rtol=1e-5, err_msg=name)


# --- The site's machinery (tools/mkdocs_hooks.py, tools/griffe_keras_examples.py,
# the vendored KaTeX): checked without a build; `.ci/run` builds the site and
# checks it in a browser (tools/check_site.py).


def tool(name):
    """A module of tools/, imported from its file (needs the `docs` extra:
    the tests that call it carry `NEEDS_DOCS_EXTRA`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_katex_is_vendored_whole_and_its_version_noted():
    katex = os.path.join(DOCS, "assets", "katex")
    note = read("docs/assets/katex/VERSION.txt")
    noted = re.match(
        r"KaTeX (\d+\.\d+\.\d+), vendored unmodified from the npm package katex@\1", note
    )
    assert noted, "VERSION.txt names the version and the npm package"
    assert f'version:"{noted.group(1)}"' in read("docs/assets/katex/katex.min.js")
    assert "MIT License" in read("docs/assets/katex/LICENSE")
    fonts = set(
        re.findall(r"url\(fonts/([\w-]+\.woff2)\)", read("docs/assets/katex/katex.min.css"))
    )
    assert len(fonts) == 20
    missing = [f for f in sorted(fonts) if not os.path.exists(os.path.join(katex, "fonts", f))]
    assert not missing, f"fonts katex.min.css uses: {missing}"
    config = read("mkdocs.yml")
    for asset in re.findall(r"^  - (assets/\S+\.(?:js|css))$", config, re.M):
        assert os.path.exists(os.path.join(DOCS, asset)), asset
    assert "assets/katex/katex.min.js" in config and "assets/katex/katex.min.css" in config


def test_no_page_loads_anything_from_the_network():
    # The site works offline: no CDN in the configuration or the pages.
    texts = [read("mkdocs.yml")] + [read(os.path.join("docs", p)) for p in docs_pages()]
    for text in texts:
        assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", text)
    assert not re.search(r"^\s*- https?://", read("mkdocs.yml"), re.M)


@NEEDS_DOCS_EXTRA
def test_notebook_table_of_contents_is_read_from_the_rendered_headings():
    hooks = tool("mkdocs_hooks")
    page = (
        '<h1 id="quick-start">Quick start<a class="anchor-link" href="#quick-start">¶</a></h1>'
        '<h2 id="the-swap-kerasmodel-fastgradmodel">The swap: <code>keras.Model</code> -&gt; '
        '<code>FastGradModel</code><a class="anchor-link" href="#x">¶</a></h2>'
        '<h3 id="3-fastgradmodels-step">3. <code>FastGradModel</code>\'s step</h3>'
        '<h2 id="what-you-saw">What you saw</h2><h2>no id</h2>'
    )
    tokens = hooks.toc_tokens(page)
    assert [(t["level"], t["id"], t["name"]) for t in tokens] == [(1, "quick-start", "Quick start")]
    children = tokens[0]["children"]
    assert [(t["id"], t["name"]) for t in children] == [
        ("the-swap-kerasmodel-fastgradmodel", "The swap: keras.Model -&gt; FastGradModel"),
        ("what-you-saw", "What you saw"),
    ]
    assert children[0]["children"][0]["name"] == "3. FastGradModel&#x27;s step"


@NEEDS_DOCS_EXTRA
def test_the_404_page_links_relative_to_the_site_root():
    hooks = tool("mkdocs_hooks")
    page = (
        '<html><head><link rel="stylesheet" href="/assets/main.css">'
        '<script>__md_scope=new URL("/",location)</script></head><body>'
        '<a href="/getting-started/">a</a><a href="/.">home</a>'
        '<a href="https://arxiv.org/abs/1">out</a><a href="#top">top</a>'
        '<script id="__config" type="application/json">{"base": "/", "search": "/assets/s.js"}</script>'
        '<script src="/assets/bundle.js"></script></body></html>'
    )
    out = hooks.relative_404(page, "/")
    assert 'href="getting-started/"' in out and 'href="."' in out
    assert 'href="https://arxiv.org/abs/1"' in out and 'href="#top"' in out
    assert not re.search(r'(href|src)=\\?"/', out), "no link from the domain's root is left"
    assert out.index("<base href") < out.index("assets/main.css")  # the base comes first
    assert '"search": "assets/s.js"' in out and 'new URL(".",document.baseURI)' in out
    # Under a sub-path (site_url set): the same page, relative to it.
    moved = page.replace('="/', '="/kfg/').replace('"/"', '"/kfg/"')
    assert 'href="getting-started/"' in hooks.relative_404(moved, "/kfg/")


@NEEDS_DOCS_EXTRA
def test_api_signatures_show_values_not_names_of_constants():
    # `GradientNoiseScale(decay=noise_scale.DEFAULT_DECAY)` reads
    # `decay=0.99` on the API page.
    import ast

    extensions = tool("griffe_keras_examples")
    import griffe

    package = griffe.load(
        "keras_fastgrad",
        search_paths=[ROOT],
        extensions=griffe.load_extensions(extensions.LiteralDefaults),
    )
    decay = package.get_member("callbacks.gradient_noise_scale.GradientNoiseScale.__init__")
    assert str(decay.parameters["decay"].default) == "0.99"
    names = []

    def walk(obj):
        for member in obj.members.values():
            if member.is_alias or member.name.startswith("_") and member.name != "__init__":
                continue
            if member.is_function:
                for parameter in member.parameters:
                    default = parameter.default
                    if default is None:
                        continue
                    try:
                        ast.literal_eval(str(default))
                    except (ValueError, SyntaxError):
                        if isinstance(default, (griffe.ExprName, griffe.ExprAttribute)):
                            names.append(f"{member.path}({parameter.name}={default})")
            elif member.is_class or member.is_module:
                walk(member)

    walk(package)
    assert not names, f"defaults shown as names of constants: {names}"


@NEEDS_DOCS_EXTRA
def test_the_build_renders_executed_notebooks_and_executes_missing_or_stale_ones(
    tmp_path, monkeypatch
):
    import json
    import shutil

    hooks = tool("mkdocs_hooks")
    from mkdocs.exceptions import PluginError

    names = sorted(n for n in os.listdir(os.path.join(ROOT, "notebooks")) if n.endswith(".ipynb"))
    executed = []

    def fake_execute(stored, folder):  # what tools/run_notebook.py writes
        executed.append(os.path.basename(stored))
        with open(stored, encoding="utf-8") as f:
            notebook = json.load(f)
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, os.path.basename(stored)), "w", encoding="utf-8") as f:
            json.dump(notebook, f)

    monkeypatch.setattr(hooks, "execute", fake_execute)
    monkeypatch.setenv("KFG_EXECUTED_NOTEBOOKS", str(tmp_path))

    def sources():
        hooks._sources.clear()
        return hooks.notebook_sources()

    # None executed yet: the build executes each, and renders the copies.
    assert sources() == {f"notebooks/{n}": str(tmp_path / n) for n in names}
    assert executed == names
    # Up to date: nothing runs again.
    executed.clear()
    sources()
    assert executed == []
    # A copy whose cells differ from the stored notebook is stale.
    stale = tmp_path / names[0]
    notebook = json.loads(stale.read_text(encoding="utf-8"))
    notebook["cells"][-1]["source"] = ["print('an older version')\n"]
    stale.write_text(json.dumps(notebook), encoding="utf-8")
    sources()
    assert executed == [names[0]]
    # A copy without outputs is refused loudly.
    shutil.copy(os.path.join(ROOT, "notebooks", names[1]), tmp_path / names[1])
    with pytest.raises(PluginError, match="no outputs"):
        sources()
    # `none`: the stored notebooks, without outputs (a warning: --strict refuses).
    monkeypatch.setenv("KFG_EXECUTED_NOTEBOOKS", "none")
    assert sources() == {f"notebooks/{n}": os.path.join(ROOT, "notebooks", n) for n in names}
