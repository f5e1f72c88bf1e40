"""A griffe extension for the API pages: Keras-style `Example:` sections.

Keras (and this package) write examples unindented under the header:

    Example:

    >>> model.fit(...)

Google-style parsing (mkdocstrings) only takes indented lines into a
section, so such examples would render as Markdown text (`>>>` as nested
quotes). This extension indents the body of every `Example:` /
`Examples:` section up to the next section header, so it renders as code.
The docstrings themselves are unchanged (doctests read the source).

It also writes a default that names a module constant as its value
(`decay=noise_scale.DEFAULT_DECAY` is shown as `decay=0.99`): the reader
of a signature wants the number, not where it is kept.
"""

import ast
import re

import griffe

SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|References|"
    r"Note|Notes|Call arguments|Input shape|Output shape)\s*:\s*$"
)
EXAMPLE = re.compile(r"^(Example|Examples)\s*:\s*$")


def indent_examples(text):
    lines, out, inside, base = text.splitlines(), [], False, 0
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if line.strip() and SECTION.match(line.strip()) and (not inside or indent <= base):
            inside = bool(EXAMPLE.match(line.strip()))
            base = indent
            out.append(line)
            continue
        if inside and line.strip() and indent <= base:
            line = " " * 4 + line
        out.append(line)
    return "\n".join(out)


class KerasExamples(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = indent_examples(obj.docstring.value)


def literal_defaults(obj, collection):
    """Replaces each parameter default of the functions under `obj` that
    names a constant (`module.NAME`, `NAME`) by the constant's literal value."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_function:
            for parameter in member.parameters:
                default = parameter.default
                if not isinstance(default, (griffe.ExprName, griffe.ExprAttribute)):
                    continue
                try:
                    constant = collection.get_member(default.canonical_path)
                except (KeyError, ValueError, AttributeError):
                    continue
                value = getattr(constant, "value", None)
                try:
                    ast.literal_eval(str(value))
                except (ValueError, SyntaxError):
                    continue
                parameter.default = str(value)
        elif member.is_class or member.is_module:
            literal_defaults(member, collection)


class LiteralDefaults(griffe.Extension):
    def on_package(self, *, pkg, loader, **kwargs):
        literal_defaults(pkg, loader.modules_collection)
