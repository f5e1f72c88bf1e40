"""What the pages tell a user to run is what CI runs, as written.

`.ci/run` reads the commands of four sections out of the pages
(`documented PAGE "HEADING"`, through `tools/doc_commands.py`) and runs them
unchanged, each in the venv its own install line makes. Here: every install
command the pages show (a `bash` block's `pip install`, `python3 -m venv`,
`apt-get install`) is one of those, the sections exist, and each venv holds
what its page says (the JAX path no TensorFlow).
"""

import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="the pages' commands, checked once (in the TensorFlow run)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = re.compile(r"\bpip install\b|\bpython3? -m venv\b|\bapt-get install\b")


def _doc_commands():
    spec = importlib.util.spec_from_file_location(
        "doc_commands", os.path.join(ROOT, "tools", "doc_commands.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOC_COMMANDS = _doc_commands()


def ci_sections():
    """`[(page, heading)]` that `.ci/run` reads and runs."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r'^documented (\S+) "([^"]+)"$', text, re.M)


def pages():
    found = ["README.md"]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        found += [
            os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".md")
        ]
    return sorted(found)


def documented_commands(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return [
        (heading, line)
        for heading, blocks in DOC_COMMANDS.sections(text)
        for block in blocks
        for line in block
    ]


def ci_commands():
    return {
        line
        for page, heading in ci_sections()
        for line in DOC_COMMANDS.commands(os.path.join(ROOT, page), heading)
    }


def test_ci_runs_the_four_documented_paths():
    assert set(ci_sections()) == {
        ("README.md", "Quick start"),
        ("README.md", "Tests"),
        ("docs/jax.md", "Install and run"),
        ("docs/contributing.md", "Development environment"),
    }
    for page, heading in ci_sections():
        assert DOC_COMMANDS.commands(os.path.join(ROOT, page), heading), (page, heading)


@pytest.mark.parametrize("page", pages())
def test_every_documented_install_command_is_one_ci_runs(page):
    run = ci_commands()
    missing = [
        f"{page}, {heading!r}: {line}"
        for heading, line in documented_commands(page)
        if INSTALL.search(line) and line not in run
    ]
    assert not missing, (
        "install commands the pages show that CI does not run as written: "
        f"{missing}. Fix: show one of the commands CI runs ({sorted(run)}), "
        'or make .ci/run read the section (`documented PAGE "HEADING"`).'
    )


def _extras(line):
    return set(re.search(r'-e "\.\[([^\]]*)\]"', line).group(1).split(","))


def test_each_venv_holds_what_its_page_says():
    quick = DOC_COMMANDS.commands(os.path.join(ROOT, "README.md"), "Quick start")
    assert quick[0].startswith("python3 -m venv .venv ") and _extras(quick[0]) == {"tf-cpu", "test"}
    assert quick[1] == ".venv/bin/python -m pytest -q -n 2"
    jax = DOC_COMMANDS.commands(os.path.join(ROOT, "docs", "jax.md"), "Install and run")
    assert jax[0].startswith("python3 -m venv .venv-jax ")
    assert not {e for e in _extras(jax[0]) if e.startswith("tf")}, (
        "the JAX path installs no TensorFlow"
    )
    assert "KERAS_BACKEND=jax .venv-jax/bin/python -m keras_fastgrad.demo" in jax[0]
    assert any(line.startswith("KERAS_BACKEND=jax .venv-jax/bin/python -m pytest") for line in jax)
    dev = DOC_COMMANDS.commands(
        os.path.join(ROOT, "docs", "contributing.md"), "Development environment"
    )
    assert dev[0].startswith("python3 -m venv .venv-dev ") and {"docs", "dev"} <= _extras(dev[0])
    assert any("mkdocs build --strict" in line for line in dev)


def test_the_reader_takes_the_first_bash_block_under_the_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# T\n\n## Quick start\n\nText.\n\n```python\nx = 1\n```\n\n```bash\n"
        "# a comment\npip install a\n\nrun b\n```\n\n```bash\nlater\n```\n\n## Next\n"
        "```bash\nother\n```\n",
        encoding="utf-8",
    )
    assert DOC_COMMANDS.commands(str(page), "Quick start") == ["pip install a", "run b"]
    assert DOC_COMMANDS.commands(str(page), "Next") == ["other"]
    with pytest.raises(DOC_COMMANDS.MissingSection, match="no ```bash block under a heading `T`"):
        DOC_COMMANDS.commands(str(page), "T")
    with pytest.raises(DOC_COMMANDS.MissingSection, match="`Missing`"):
        DOC_COMMANDS.commands(str(page), "Missing")
