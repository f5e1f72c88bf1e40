"""MkDocs hooks for the documentation site (`mkdocs.yml`: `hooks:`).

The site shows files that live outside `docs/`, without copying them there
(one copy each, so they cannot go stale):

- `CHANGELOG.md` as the Changelog page;
- `benchmarks/RESULTS.md`, `benchmarks/RESULTS-large.md` and
  `benchmarks/results.png` as the Benchmarks' latest results;
- the four notebooks of `notebooks/`, executed: the site renders the copy
  that `tools/run_notebook.py` wrote, with its outputs and plots, into
  `KFG_EXECUTED_NOTEBOOKS` (default `build/executed-notebooks`; `.ci/run`'s
  test run writes them there). A notebook with no executed copy there, or
  whose copy no longer matches its cells, is executed by the build itself
  (a fresh Python process each, up to a minute or so on 2 cores), and the
  build stops if one fails. `KFG_EXECUTED_NOTEBOOKS=none` renders the
  stored notebooks without outputs, for a quick preview: that is logged as
  a warning, so `mkdocs build --strict` refuses it.

And it mends two things of the rendered pages:

- a notebook page's table of contents is read from its rendered headings
  (mkdocs-jupyter's drops inline code from the labels and the anchors:
  `#the-swap-` for "The swap: `keras.Model` -> `FastGradModel`");
- `404.html` links relative to the site's root, found when the page is
  shown (see `relative_404`): the site works under any path, not only at a
  domain's root.
"""

import html
import json
import logging
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from urllib.parse import urlsplit

from mkdocs.exceptions import PluginError
from mkdocs.plugins import CombinedEvent, event_priority
from mkdocs.structure.files import File
from mkdocs.structure.toc import get_toc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tools", "run_notebook.py")
DEFAULT_EXECUTED = os.path.join(ROOT, "build", "executed-notebooks")
NOTEBOOK_TIMEOUT_S = 600
log = logging.getLogger("mkdocs.hooks.keras_fastgrad")

# site path -> repository path
EXTERNAL = {
    "changelog.md": "CHANGELOG.md",
    "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
    "benchmarks/RESULTS-large.md": "benchmarks/RESULTS-large.md",
    "benchmarks/results.png": "benchmarks/results.png",
}


def executed_folder():
    """Where the executed notebooks are, or None to render the stored ones."""
    folder = os.environ.get("KFG_EXECUTED_NOTEBOOKS") or DEFAULT_EXECUTED
    if folder.lower() == "none":
        return None
    return os.path.abspath(folder)


def cell_sources(path):
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return [(c["cell_type"], "".join(c["source"])) for c in cells]


def has_outputs(path):
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return any(c.get("outputs") for c in cells if c["cell_type"] == "code")


def execute(stored, folder):
    """Runs `stored` with tools/run_notebook.py, writing it into `folder`."""
    name = os.path.basename(stored)
    log.info("executing notebooks/%s into %s (no up-to-date executed copy)", name, folder)
    env = dict(os.environ, KFG_EXECUTED_NOTEBOOKS=folder, MPLBACKEND="Agg")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    try:
        result = subprocess.run(
            [sys.executable, RUNNER, stored],
            capture_output=True,
            text=True,
            timeout=NOTEBOOK_TIMEOUT_S,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        raise PluginError(f"notebooks/{name} ran over {NOTEBOOK_TIMEOUT_S} s.") from e
    if result.returncode != 0:
        raise PluginError(
            f"notebooks/{name} failed, so the site cannot show it executed:\n"
            f"{result.stderr[-4000:]}\nRun it alone: python tools/run_notebook.py {stored}"
        )


_sources = {}


def notebook_sources():
    """`{site path: file to render}` for every notebook in `notebooks/`,
    executing those without an up-to-date executed copy (once a build)."""
    if _sources:
        return dict(_sources)
    folder = executed_folder()
    for name in sorted(os.listdir(os.path.join(ROOT, "notebooks"))):
        if not name.endswith(".ipynb"):
            continue
        stored = os.path.join(ROOT, "notebooks", name)
        if folder is None:
            log.warning("KFG_EXECUTED_NOTEBOOKS=none: notebooks/%s rendered without outputs", name)
            _sources[f"notebooks/{name}"] = stored
            continue
        copy = os.path.join(folder, name)
        if not os.path.exists(copy) or cell_sources(copy) != cell_sources(stored):
            execute(stored, folder)
        if not has_outputs(copy):
            raise PluginError(f"{copy}: the executed notebook has no outputs.")
        _sources[f"notebooks/{name}"] = copy
    return dict(_sources)


def on_startup(command, dirty):
    _sources.clear()


def on_pre_build(config):
    _sources.clear()  # `mkdocs serve`: a rebuild checks the notebooks again


@event_priority(100)  # before mkdocs-jupyter turns the .ipynb files into pages
def add_external_files(files, config):
    sources = {uri: os.path.join(ROOT, path) for uri, path in EXTERNAL.items()}
    sources.update(notebook_sources())
    for uri, path in sources.items():
        files.append(File.generated(config, uri, abs_src_path=path))
    return files


@event_priority(-100)  # after mkdocs-jupyter wrapped them
def restore_notebook_paths(files, config):
    # mkdocs-jupyter's wrapper recomputes `abs_src_path` from a `src_dir`
    # that a generated file does not have: give it back the real path.
    for uri, path in notebook_sources().items():
        file = files.get_file_from_path(uri)
        if file is not None:
            file.__dict__["abs_src_path"] = path
    return files


on_files = CombinedEvent(add_external_files, restore_notebook_paths)


class Headings(HTMLParser):
    """`[(level, id, text)]` of the `<h1>`..`<h6>` that have an id."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found, self._open, self._skip = [], None, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag) and attrs.get("id"):
            self._open = [int(tag[1]), attrs["id"], ""]
        elif self._open and tag == "a" and "anchor-link" in (attrs.get("class") or ""):
            self._skip += 1  # the pilcrow after the heading's text

    def handle_endtag(self, tag):
        if self._open and tag == "a" and self._skip:
            self._skip -= 1
        elif self._open and tag == f"h{self._open[0]}":
            level, anchor, text = self._open
            self.found.append((level, anchor, " ".join(text.split())))
            self._open = None

    def handle_data(self, data):
        if self._open and not self._skip:
            self._open[2] += data


def toc_tokens(page_html):
    """Nested TOC tokens (as Markdown's `toc` extension makes them)."""
    parser = Headings()
    parser.feed(page_html)
    tokens, stack = [], []
    for level, anchor, text in parser.found:
        token = {"level": level, "id": anchor, "name": html.escape(text), "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
    return tokens


def on_page_content(page_html, page, config, files):
    if page.file.src_uri.endswith(".ipynb"):
        page.toc = get_toc(toc_tokens(page_html))
    return page_html


# In 404.html: find the site's root, the first folder up from the address
# shown that holds this very 404.html, and make it the page's base.
BASE_SCRIPT = """<script>(function () {
  var parts = location.pathname.split("/").slice(0, -1), request;
  for (var n = parts.length; n > 0; n--) {
    var root = parts.slice(0, n).join("/") + "/";
    try {
      request = new XMLHttpRequest();
      request.open("HEAD", root + "404.html", false);
      request.send();
      if (request.status === 200) break;
    } catch (e) {}
  }
  document.write('<base href="' + root + '">');
})();</script>"""
# Material's own scripts read the root from their config: the same one.
CONFIG_SCRIPT = """<script>(function () {
  var element = document.getElementById("__config"), config = JSON.parse(element.textContent);
  config.base = document.baseURI;
  element.textContent = JSON.stringify(config);
})();</script>"""


def relative_404(text, base_path):
    """404.html with its links relative to the site's root and a base set
    at load time (MkDocs writes them from the domain's root: `/...`)."""
    base_path = "/" + base_path.strip("/") + "/" if base_path.strip("/") else "/"

    def relative(match):
        attribute, target = match.group(1), match.group(2)
        if target.startswith("//") or not target.startswith(base_path):
            return match.group(0)
        return f'{attribute}="{target[len(base_path) :] or "./"}"'

    text = re.sub(r'\b(href|src)="(/[^"]*)"', relative, text)
    text = text.replace(f'new URL("{base_path}",location)', 'new URL(".",document.baseURI)')
    text = text.replace(f'"search": "{base_path}', '"search": "')
    text = re.sub(
        r'(<script id="__config" type="application/json">.*?</script>)',
        lambda m: m.group(1) + CONFIG_SCRIPT,
        text,
        count=1,
        flags=re.S,
    )
    # Written by a script, so that the browser's preload scanner, which
    # runs ahead of the base script, does not ask for them under the
    # address shown.
    text = re.sub(
        r'<link\b[^>]*\bhref="(?![a-z]+:|/|#)[^"]*"[^>]*>|<script\b[^>]*\bsrc="(?![a-z]+:|/)[^"]*"[^>]*></script>',
        lambda m: (
            "<script>document.write(%s)</script>" % json.dumps(m.group(0)).replace("</", "<\\/")
        ),
        text,
    )
    return text.replace("<head>", "<head>\n" + BASE_SCRIPT, 1)


def on_post_build(config):
    path = os.path.join(config.site_dir, "404.html")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(relative_404(text, urlsplit(config.site_url or "/").path))
