"""The shell commands a page documents, read out of the page itself.

    python tools/doc_commands.py PAGE.md "HEADING"

prints the lines of the first ```bash block under the heading `HEADING`
of `PAGE.md` (any level, the heading's text exactly), one command a line,
as a reader would copy them. `.ci/run` runs what this prints, unchanged:
the README's Quick start, its full tier, the docs build of
docs/contributing.md and the JAX path of docs/jax.md are tested as
written, not as a copy of them. `tests/test_documented_commands.py` checks
that every install command of the pages is one of those CI runs.
"""

import re
import sys

HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


class MissingSection(ValueError):
    """The page has no such heading, or no bash block under it."""


def sections(text):
    """`[(heading, [bash blocks' lines...])]` of a Markdown text, in order:
    each heading with the ```bash blocks that follow it before the next
    heading."""
    found, lines, i = [], text.splitlines(), 0
    current = None
    while i < len(lines):
        heading = HEADING.match(lines[i])
        opening = FENCE.match(lines[i])
        if heading:
            current = (heading.group("text"), [])
            found.append(current)
            i += 1
            continue
        if opening:
            fence, info = opening.group("fence"), opening.group("info").strip("{} .").lower()
            body, j = [], i + 1
            while j < len(lines) and lines[j].strip() != fence:
                body.append(lines[j].strip())
                j += 1
            if info.split()[:1] == ["bash"] and current is not None:
                current[1].append([line for line in body if line and not line.startswith("#")])
            i = j + 1
            continue
        i += 1
    return found


def commands(path, heading):
    """The commands of the first bash block under `heading` in `path`.

    Raises:
        MissingSection: naming the page and the heading.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for title, blocks in sections(text):
        if title == heading:
            if not blocks:
                break
            return blocks[0]
    raise MissingSection(
        f"{path} has no ```bash block under a heading `{heading}`: CI runs the "
        "commands it documents there (.ci/run). Fix: keep the heading and its "
        "block, or change .ci/run and the page together."
    )


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print('usage: python tools/doc_commands.py PAGE.md "HEADING"', file=sys.stderr)
        return 2
    try:
        lines = commands(*argv)
    except MissingSection as error:
        print(error, file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
