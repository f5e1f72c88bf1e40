"""MkDocs hooks for the documentation site (`mkdocs.yml`: `hooks:`).

The site shows files that live outside `docs/`, without copying them there
(one copy each, so they cannot go stale):

- `CHANGELOG.md` as the Changelog page;
- `benchmarks/RESULTS.md` and `benchmarks/results.png` as the Benchmarks'
  latest results;
- the four notebooks of `notebooks/`. When `KFG_EXECUTED_NOTEBOOKS` names a
  folder that holds a notebook executed by `tests/run_notebook.py` (as
  `.ci/run` does during the test run), the executed copy, with its outputs
  and plots, is rendered instead of the stored (stripped) one. Nothing is
  executed at build time.
"""

import logging
import os

from mkdocs.plugins import CombinedEvent, event_priority
from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("mkdocs.hooks.keras_fastgrad")

# site path -> repository path
EXTERNAL = {
    "changelog.md": "CHANGELOG.md",
    "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
    "benchmarks/results.png": "benchmarks/results.png",
}


def notebook_sources():
    """`{site path: file to render}` for every notebook in `notebooks/`."""
    executed = os.environ.get("KFG_EXECUTED_NOTEBOOKS")
    sources, stale = {}, []
    for name in sorted(os.listdir(os.path.join(ROOT, "notebooks"))):
        if not name.endswith(".ipynb"):
            continue
        stored = os.path.join(ROOT, "notebooks", name)
        candidate = os.path.join(executed, name) if executed else None
        if candidate and os.path.exists(candidate):
            sources[f"notebooks/{name}"] = candidate
        else:
            sources[f"notebooks/{name}"] = stored
            stale.append(name)
    if executed and stale:
        log.info("no executed copy in %s of %s: rendering them without outputs", executed, stale)
    return sources


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
