"""The README and the install pages as a newcomer reads them.

The README leads with what the package is, the comparison, the install on
both backends, a short example and the two commands, and only then the
speed (a short table: tests/test_run_all.py) and the code's layout. The
JAX install is JAX-only and the same wherever a page shows it; the fast
tier's time is one figure; the package's one-line descriptions name both
backends; the distributed page has a JAX recipe.
"""

import configparser
import os
import re

import pytest

pytestmark = pytest.mark.tensorflow_only(reason="the README, checked once (in the TensorFlow run)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The JAX path as CI runs it (docs/jax.md, "Install and run").
JAX_LINES = [
    'python3 -m venv .venv-jax && .venv-jax/bin/pip install -q -c constraints.txt -e ".[jax,test]"'
    " regex tokenizers sentencepiece kagglehub && .venv-jax/bin/pip install -q --no-deps"
    " -c constraints.txt keras-hub && KERAS_BACKEND=jax .venv-jax/bin/python -m keras_fastgrad.demo",
    "KERAS_BACKEND=jax .venv-jax/bin/python -m pytest -q -n 2",
]


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def headings(text):
    return [(m.start(), m.group(2)) for m in re.finditer(r"^(#+) (.+)$", text, re.M)]


def bash_blocks(text):
    return [
        block.strip("\n").splitlines() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
    ]


def first_bash_block_under(text, heading):
    start = text.index(f"\n{heading}\n")
    return bash_blocks(text[start:])[0]


def test_the_readme_leads_with_the_example_and_the_commands_then_the_speed():
    text = read("README.md")
    order = [title for _, title in headings(text) if not title.startswith("keras_fastgrad")]
    assert order[:4] == ["Install", "Example", "Quick start", "Tests"], order
    assert order.index("Speed") > order.index("Quick start")
    assert text.index("<!-- --8<-- [start:comparison] -->") < text.index("## Install")
    # The example on the first screens, not after the speed tables.
    first_python = text[: text.index("```python")].count("\n")
    assert first_python < 70, f"the first example starts at line {first_python + 1}"
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(example) <= 10


def test_the_readme_installs_both_backends():
    text = read("README.md")
    install = text[text.index("## Install") : text.index("## Example")]
    assert '".[tf-cpu]"' in install and '".[jax]"' in install and "demo" in install
    assert JAX_LINES in bash_blocks(text)


def test_the_readme_tree_names_every_subpackage():
    tree = re.search(r"```text\nkeras_fastgrad/\n(.*?)```", read("README.md"), re.S).group(1)
    package = os.path.join(ROOT, "keras_fastgrad")
    subpackages = sorted(
        name
        for name in os.listdir(package)
        if os.path.exists(os.path.join(package, name, "__init__.py"))
    )
    assert {"maths", "backend"} <= set(subpackages)
    missing = [name for name in subpackages if f"  {name}/" not in tree]
    assert not missing, f"README.md's architecture tree leaves out {missing}"


def test_the_jax_install_is_jax_only_and_the_same_on_every_page():
    jax = read("docs/jax.md")
    assert first_bash_block_under(jax, "## Install and run") == JAX_LINES
    order = [title for _, title in headings(jax)]
    assert order.index("What each backend supports") < order.index("Install and run") <= 2
    getting_started = read("docs/getting-started.md")
    section = getting_started[getting_started.index("## On TensorFlow or on JAX") :]
    assert JAX_LINES in bash_blocks(section) or "jax.md#install-and-run" in section
    # No page installs TensorFlow for JAX (".[tf-cpu,jax]" did).
    for page in ("README.md", "docs/getting-started.md", "docs/jax.md"):
        for block in bash_blocks(read(page)):
            for line in block:
                extras = re.findall(r'-e "\.\[([^\]]*)\]"', line)
                for found in extras:
                    names = set(found.split(","))
                    assert not ({"jax"} & names and {"tf", "tf-cpu"} & names), (page, line)


def test_the_jax_page_says_how_each_backend_averages_per_output_losses():
    jax = read("docs/jax.md")
    assert "## Per-output losses in the logs" in jax
    part = jax[jax.index("## Per-output losses in the logs") :]
    part = part[: part.index("\n## ", 1)]
    assert "`<output>_loss`" in part and "```python" in part  # (run on both: tests/test_docs.py)


def test_the_fast_tiers_time_is_one_figure():
    figures = set()
    for page in ("README.md", "docs/getting-started.md", "docs/contributing.md"):
        flat = " ".join(read(page).split())
        found = re.findall(
            r"fast tier[^()]*?\([^()]*?([\d.]+ (?:s|seconds|minutes)) measured", flat
        )
        assert found, f"{page} gives no time for the fast tier"
        figures |= set(found)
    assert len(figures) == 1, f"the fast tier's time, given as {sorted(figures)}"


def test_the_package_descriptions_name_both_backends():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert "TensorFlow and JAX" in config["metadata"]["description"]
    site = re.search(r"^site_description: (.+)$", read("mkdocs.yml"), re.M).group(1)
    assert "TensorFlow and JAX" in site


def test_the_distributed_page_has_a_jax_recipe():
    text = read("docs/how-to/distributed.md")
    jax = text[text.index("## JAX") :]
    assert re.search(r"```python\n[^`]*keras\.distribution\.DataParallel", jax)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in jax
