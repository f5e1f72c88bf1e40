"""A griffe extension for the API pages: Keras-style `Example:` sections.

Keras (and this package) write examples unindented under the header:

    Example:

    >>> model.fit(...)

Google-style parsing (mkdocstrings) only takes indented lines into a
section, so such examples would render as Markdown text (`>>>` as nested
quotes). This extension indents the body of every `Example:` /
`Examples:` section up to the next section header, so it renders as code.
The docstrings themselves are unchanged (doctests read the source).
"""

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
