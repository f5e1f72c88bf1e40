"""One statement of what each backend supports, from the code's own record.

`keras_fastgrad/step/support.py` holds the rows (`BACKEND_SUPPORT`); the
JAX refusals raise the errors their rows make. Here: docs/jax.md shows the
rows as the code renders them, the README's summary is the code's, every
page that states backend support shows or links that statement, no page
contradicts it (multi-task merging runs on JAX), and every refusal the code
raises has its row, and the reverse.
"""

import os
import re

import pytest

from keras_fastgrad.step import support

pytestmark = pytest.mark.tensorflow_only(
    reason="the pages' statement of support, checked once (in the TensorFlow run)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pages that state what each backend supports.
STATING = (
    "README.md",
    "docs/index.md",
    "docs/supported-versions.md",
    "docs/jax.md",
    "docs/getting-started.md",
)
INCLUDES = ('--8<-- "README.md:backend-summary"', '--8<-- "docs/jax.md:backend-support"')


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def section(text, name):
    """The text between a snippet section's markers, or None."""
    start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def pages():
    found = ["README.md"]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        found += [
            os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/")
            for n in names
            if n.endswith(".md")
        ]
    return sorted(found)


def test_the_jax_page_shows_the_codes_statement():
    shown = section(read("docs/jax.md"), "backend-support")
    assert shown == support.markdown_table(), (
        "docs/jax.md's table differs from keras_fastgrad/step/support.py's rows: put "
        "`support.markdown_table()` between its backend-support markers"
    )


def test_the_readme_summary_is_the_codes():
    # (The README is no site page: it cannot include the table, so it shows
    # the code's summary, checked here.)
    assert section(read("README.md"), "backend-summary") == support.summary()


@pytest.mark.parametrize("page", STATING)
def test_each_page_that_states_backend_support_shows_or_links_the_statement(page):
    text = read(page)
    shown = section(text, "backend-support") or section(text, "backend-summary")
    included = any(include in text for include in INCLUDES)
    linked = "jax.md#what-each-backend-supports" in text
    assert shown or included or linked, (
        f"{page} states what each backend supports: include the statement "
        f"({' or '.join(INCLUDES)}) or link docs/jax.md#what-each-backend-supports"
    )


# What the pages said before the statement: "on JAX (all but multi-task
# merging)", "runs every option but `multitask` ... it is refused there".
CONTRADICTIONS = (
    r"all but multi-?task",
    r"(every|all) options? but `?multitask",
    r"`?multi-?task`?[^.|]{0,80}\brefused (there|on JAX)",
    r"\bJAX\b[^.|]{0,80}\brefuses?\b[^.|]{0,40}`?multi-?task",
)


def contradictions(text):
    flat = " ".join(text.split())
    return [m.group(0) for p in CONTRADICTIONS for m in re.finditer(p, flat, re.I)]


@pytest.mark.parametrize("page", pages())
def test_no_page_says_multitask_is_refused_on_jax(page):
    found = contradictions(read(page))
    assert not found, f"{page} contradicts keras_fastgrad/step/support.py: {found}"


def test_the_contradictions_are_found():
    assert contradictions("on TensorFlow, and\non JAX (all but multi-task merging).")
    assert contradictions("runs every option but\n  `multitask` (it is refused there, by name)")
    assert not contradictions("`multitask` with `micro_batches` in features space is refused.")


def test_the_record_says_multitask_runs_on_jax():
    rows = [r for r in support.BACKEND_SUPPORT if r.feature.startswith("`multitask`")]
    assert [(r.tensorflow, r.jax) for r in rows] == [(support.SUPPORTED, support.SUPPORTED)]


def raised_keys():
    """The keys of every `refusal("...")` in the package's code, and the
    rows the generic refusals raise from the record
    (`step.trainer.check_options`, `check_callback`): a key naming an option
    of `FastGradModel` or a callback class."""
    from keras_fastgrad import callbacks
    from keras_fastgrad.models import model

    generic = {*model._DEFAULT_OPTIONS, *callbacks.__all__}
    keys = {r.key for r in support.BACKEND_SUPPORT if r.key in generic}
    package = os.path.join(ROOT, "keras_fastgrad")
    for folder, _, names in os.walk(package):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    keys |= set(re.findall(r'\brefusal\(\s*"(\w+)"', f.read()))
    return keys


def test_every_refusal_the_code_raises_has_its_row_and_every_row_is_raised():
    refused = {r.key for r in support.BACKEND_SUPPORT if r.jax == support.REFUSED}
    assert refused == set(support.JAX_REFUSALS), "a refused row without its key, or the reverse"
    assert raised_keys() == set(support.JAX_REFUSALS), (
        "the refusals the code raises (`refusal(key, ...)`) and the rows marked refused differ"
    )
    assert "loss_scale_factor" in raised_keys()


@pytest.mark.parametrize("key", sorted(support.JAX_REFUSALS))
def test_a_refusal_says_what_its_row_says(key):
    row = support.JAX_REFUSALS[key]
    message = str(support.refusal(key, "x=1"))
    assert row.feature[1:] in message and row.note in message and row.fix in message
    assert "not yet supported on Keras' JAX backend" in message
    assert "Received: x=1" in message and "KERAS_BACKEND=tensorflow" in message


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_an_option_or_callback_the_record_refuses_is_refused_on_its_backend_only(
    monkeypatch, backend
):
    # The generic refusals read the record alone: a row keyed by an option's
    # (or a callback class's) name, refused on JAX, refuses it there.
    from keras_fastgrad.step import trainer

    rows = {
        key: support.Feature(f"`{key}`", jax=support.REFUSED, note="a test's row", key=key)
        for key in ("clip_norm", "NonFiniteGuard")
    }
    monkeypatch.setattr(support, "JAX_REFUSALS", rows)
    monkeypatch.setattr(trainer, "JAX_REFUSALS", rows)

    class NonFiniteGuard:
        pass

    defaults = {"clip_norm": None, "accumulation_steps": 1}
    trainer.check_options({"clip_norm": None, "accumulation_steps": 4}, defaults, backend)
    if backend == "tensorflow":
        trainer.check_options({"clip_norm": 1.0, "accumulation_steps": 1}, defaults, backend)
        trainer.check_callback(NonFiniteGuard(), None, backend)
        return
    with pytest.raises(NotImplementedError, match=r"Received: clip_norm=1\.0 with"):
        trainer.check_options({"clip_norm": 1.0, "accumulation_steps": 1}, defaults, backend)
    with pytest.raises(NotImplementedError, match=r"Received: NonFiniteGuard\(\.\.\.\) with"):
        trainer.check_callback(NonFiniteGuard(), None, backend)
