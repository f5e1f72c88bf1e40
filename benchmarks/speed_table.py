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
START, END = "<!-- speed-table:start -->", "<!-- speed-table:end -->"
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


def between_markers(text):
    """The text between the speed-table markers, or None without them."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def sync_docs(table_text, root=ROOT, pages=DOCS):
    """Puts `table_text` between the markers of each page that has them;
    returns the pages changed."""
    changed = []
    for page in pages:
        path = os.path.join(root, page)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        if between_markers(text) is None or between_markers(text) == table_text.strip("\n"):
            continue
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        with open(path, "w") as f:
            f.write(f"{before}{START}\n{table_text.strip(chr(10))}\n{END}{after}")
        changed.append(page)
    return changed


def main():
    with open(os.path.join(HERE, "RESULTS.md")) as f:
        table = between_markers(f.read())
    if table is None:
        sys.exit(f"benchmarks/RESULTS.md has no {START} ... {END}: run benchmarks/run_all.py")
    changed = sync_docs(table)
    print(f"Speed table copied into {', '.join(changed) or 'nothing (already equal)'}.")


if __name__ == "__main__":
    main()
