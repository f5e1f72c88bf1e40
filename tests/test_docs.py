"""Every public class and function has a Keras-style docstring.

Public: the classes and functions exported by `keras_fastgrad` and
`keras_fastgrad.callbacks` (their `__all__`) and defined in
`keras_fastgrad.aggregators` (names without a leading underscore). Each
docstring needs

- a summary line: one sentence on the first line, ending with a period;
- an `Args:` section naming every argument, where the object takes any
  (a class: its `__init__`; `*args` / `**kwargs` are not required; a
  dataclass may document its fields under `Attributes:`);
- an `Example` section with `>>>` lines. The examples run as doctests in the
  same `python -m pytest` run (`--doctest-modules` in pyproject.toml).

Gaps known when this test was written are listed in `KNOWN_GAPS`, so the
list is visible and does not grow; a fixed gap must be removed from it.
"""

import dataclasses
import inspect
import re

import pytest

import keras_fastgrad
from keras_fastgrad import aggregators, callbacks

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
