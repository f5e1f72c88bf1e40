"""The short speed table (bench_targets' rows) and its copies in the docs.

    python benchmarks/speed_table.py   # copy RESULTS.md's table into the docs

`run_all.py` writes the table into `benchmarks/RESULTS.md` and
`benchmarks/out/speed_table.md`, between the markers below, and copies it
between the same markers in README.md and docs/index.md, so that no page
shows a figure the latest run does not.
"""

import os
import statistics
import sys

from verdicts import fmt, rows

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = ("README.md", os.path.join("docs", "index.md"))


def markers(page="RESULTS"):
    """The markers of a page's speed table: `speed-table` for RESULTS.md,
    `speed-table-<page>` for another page of `run_all.py --page`."""
    tag = "speed-table" if page == "RESULTS" else f"speed-table-{page}"
    return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


START, END = markers()
TARGETS_SCRIPT = "targets"  # bench_targets.py: issue 28's table


def speed_table(runs, header):
    """The short table for README/docs: bench_targets' rows as one line per
    pair and one column per model (rows are named "<model>: <pair>"); a
    cell holds the figure (the median over processes, their range) and the
    verdict, and its target where it differs from the pair's. Then the line
    that says where the figures come from."""
    table = {
        k: r for k, r in rows(runs).items() if k[0] == TARGETS_SCRIPT and r["kind"] == "step time"
    }
    if not table:
        return f"No speed table: `bench_{TARGETS_SCRIPT}.py` did not run.\n"
    pairs, models = {}, {}
    for (_, _, name), row in table.items():
        model, pair = name.split(": ", 1) if ": " in name else ("figure", name)
        pairs.setdefault(pair, {})[model] = row
        models[model] = None
    lines = [
        "| pair | target | " + " | ".join(models) + " |",
        "|---|---|" + "---:|" * len(models),
    ]
    for pair, cells in pairs.items():
        targets = [row["target"] or "" for row in cells.values()]
        common = max(dict.fromkeys(targets), key=targets.count)
        shown = []
        for model in models:
            row = cells.get(model)
            if row is None or not row["figures"]:
                shown.append("-" if row is None else "not measured")
                continue
            figures = row["figures"]
            cell = fmt(statistics.median(figures), 2)
            if len(figures) > 1:
                cell += f" ({fmt(min(figures), 2)}-{fmt(max(figures), 2)})"
            cell += f" {row['verdict']}" if row["verdict"] else ""
            cell += f" ({row['target']})" if (row["target"] or "") != common else ""
            shown.append(cell)
        lines.append(f"| {pair} | {common or 'reported'} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n\n" + header + "\n"


def write_speed_table(text, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def between_markers(text, page="RESULTS"):
    """The text between `page`'s speed-table markers, or None without them."""
    start, end = markers(page)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def sync_docs(table_text, root=ROOT, pages=DOCS, page="RESULTS"):
    """Puts `table_text` between `page`'s markers in each of `pages` that
    has them; returns the pages changed."""
    start, end = markers(page)
    changed = []
    for doc in pages:
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        shown = between_markers(text, page)
        if shown is None or shown == table_text.strip("\n"):
            continue
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        with open(path, "w") as f:
            f.write(f"{before}{start}\n{table_text.strip(chr(10))}\n{end}{after}")
        changed.append(doc)
    return changed


def pages_with_tables():
    """RESULTS and every other benchmarks/<page>.md that has its markers."""
    found = []
    for name in sorted(os.listdir(HERE)):
        page = name[: -len(".md")] if name.endswith(".md") else None
        if page and os.path.isfile(os.path.join(HERE, name)):
            with open(os.path.join(HERE, name)) as f:
                if between_markers(f.read(), page) is not None:
                    found.append(page)
    return found


def main():
    with open(os.path.join(HERE, "RESULTS.md")) as f:
        if between_markers(f.read()) is None:
            sys.exit(f"benchmarks/RESULTS.md has no {START} ... {END}: run benchmarks/run_all.py")
    changed = []
    for page in pages_with_tables():
        with open(os.path.join(HERE, f"{page}.md")) as f:
            changed += sync_docs(between_markers(f.read(), page), page=page)
    print(f"Speed tables copied into {', '.join(changed) or 'nothing (already equal)'}.")


if __name__ == "__main__":
    main()
