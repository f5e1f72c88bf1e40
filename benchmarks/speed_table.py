"""The speed tables of the docs, copied from the latest runs' pages.

    python benchmarks/speed_table.py   # copy the tables into the docs again

`run_all.py` writes bench_targets' table into `benchmarks/RESULTS.md` (or
`benchmarks/<page>.md`) and `benchmarks/out/speed_table.md`, between the
markers below, and copies it between the same markers in docs/index.md
(`DOCS`), so that no page shows a figure the latest run does not. The
README shows a short table instead (`summary_table`: six rows in plain
words, TensorFlow and JAX), made from RESULTS.md, RESULTS-large.md and
RESULTS-jax.md and copied between its `speed-summary` markers the same way.
"""

import os
import re
import statistics
import sys

from verdicts import fmt, rows

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = (os.path.join("docs", "index.md"),)


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


SUMMARY_MARKERS = ("<!-- speed-summary:start -->", "<!-- speed-summary:end -->")
SUMMARY_DOCS = ("README.md",)
# (column, results page, the model as that page names it)
SUMMARY_COLUMNS = (
    ("TensorFlow, MLP 64", "RESULTS", "MLP 64-3x256-10"),
    ("TensorFlow, MLP 256", "RESULTS-large", "MLP 256-3x1024-10"),
    ("JAX, MLP 64", "RESULTS-jax", "JAX MLP 64-3x256-10"),
    ("JAX, MLP 256", "RESULTS-jax", "JAX MLP 256-3x1024-10"),
)
# (measured, against, [(the pair as the pages name it, a mark when it stands
# in for the first)]: the first pair a page measured)
SUMMARY_ROWS = (
    (
        "`FastGradModel()`: a batch with NaN or Inf never reaches the weights",
        "`keras.Model` that applies only finite gradients",
        [("default / keras.Model gated on finite gradients", "")],
    ),
    (
        "`FastGradModel(accumulation_steps=4)`",
        "`gradient_accumulation_steps=4`, finite gradients only",
        [("accumulation_steps=4 / gradient_accumulation_steps=4 gated", "")],
    ),
    (
        "`FastGradModel(clip_norm=1)`",
        "`global_clipnorm=1`, finite gradients only",
        [
            ("clip_norm=1 / global_clipnorm=1 gated", ""),
            ("clip_norm=1 / global_clipnorm=1", "*"),
        ],
    ),
    (
        "`FastGradModel(clip_norm=1)` with the telemetry of 3 callbacks",
        "`global_clipnorm=1`, finite gradients only, 5 more log keys",
        [("clip_norm=1 + 3 callbacks / global_clipnorm=1 gated with 5 log keys", "")],
    ),
    (
        "`FastGradModel()`",
        "plain `keras.Model`, which applies NaN too: what the safety costs",
        [("default / keras.Model (not gated)", "")],
    ),
    (
        "`keras.Model`",
        "a second `keras.Model` built alike: the noise of the method",
        [("keras.Model / keras.Model alike (A/A: the noise)", "")],
    ),
)
SUMMARY_MARKS = {
    "*": "against `global_clipnorm=1` without the finite check (the pair with it is not "
    "measured on JAX)"
}


def shown_cell(text, page, model, pair):
    """The figure the page's own speed table shows for `pair` on `model`
    (`"1.02 (1.01-1.06)"`, its verdict left out), or None."""
    table = between_markers(text, page)
    if table is None:
        return None
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")] if lines else []
    if model not in header:
        return None
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == pair and len(cells) == len(header):
            figure = re.match(r"\d+\.\d+(?: \(\d+\.\d+-\d+\.\d+\))?", cells[header.index(model)])
            return figure.group(0) if figure else None
    return None


def per_process(text, name):
    """A step-time row's figures, one per process, from a results page's
    detail tables (`| <model>: <pair> | step time | a / b / c | ...`), or
    None where the page has no such row."""
    found = re.search(rf"^\| {re.escape(name)} \| step time \| ([^|]+) \|", text, re.M)
    if found is None:
        return None
    figures = []
    for cell in found.group(1).split("/"):
        try:
            figures.append(float(cell))
        except ValueError:
            continue
    return figures or None


def summary_table(results_dir=HERE):
    """The README's speed table: per row what `FastGradModel` runs against
    the Keras configuration doing the same work, per column a backend and a
    model; a cell is the median ratio over the processes (their range), read
    from the latest results pages (`SUMMARY_COLUMNS`)."""
    texts, sources = {}, []
    for _, page, _ in SUMMARY_COLUMNS:
        if page in texts:
            continue
        path = os.path.join(results_dir, f"{page}.md")
        texts[page] = ""
        if os.path.exists(path):
            with open(path) as f:
                texts[page] = f.read()
        date = re.search(r"^- Date: (\S+)", texts[page], re.M)
        processes = re.search(r"^- Processes: (\d+)", texts[page], re.M)
        if date and processes:
            sources.append(f"{page}.md ({date.group(1)}, {processes.group(1)} processes)")
    lines = [
        "| measured | against | " + " | ".join(c for c, _, _ in SUMMARY_COLUMNS) + " |",
        "|---|---|" + "---:|" * len(SUMMARY_COLUMNS),
    ]
    marks = []
    for ours, keras, pairs in SUMMARY_ROWS:
        cells = []
        for _, page, model in SUMMARY_COLUMNS:
            cell = "not measured"
            for pair, mark in pairs:
                # The page's speed table where it shows the pair (figures
                # rounded from the run's own), else its detail rows.
                shown = shown_cell(texts[page], page, model, pair)
                figures = per_process(texts[page], f"{model}: {pair}")
                if shown or figures:
                    cell = shown or fmt(statistics.median(figures), 2)
                    if not shown and len(figures) > 1:
                        cell += f" ({fmt(min(figures), 2)}-{fmt(max(figures), 2)})"
                    cell += mark
                    marks += [mark] if mark and mark not in marks else []
                    break
            cells.append(cell)
        lines.append(f"| {ours} | {keras} | " + " | ".join(cells) + " |")
    notes = "".join(f" {mark} {SUMMARY_MARKS[mark]}." for mark in marks)
    return (
        "\n".join(lines)
        + "\n\nEach figure: the compiled train step's time, the first column's over the "
        "second's (1.00: as fast, below 1: faster), the median over the processes, the "
        "lowest and highest in brackets; MLP 64: 64 -> 3 x 256 -> 10, "
        "MLP 256: 256 -> 3 x 1024 -> 10, batches of 64, on 2 CPU cores. From benchmarks/"
        + ", ".join(sources)
        + "."
        + notes
        + "\n"
    )


def sync_summary(results_dir=HERE, root=ROOT, pages=SUMMARY_DOCS):
    """Puts `summary_table()` between the `speed-summary` markers of each of
    `pages` that has them; returns the pages changed."""
    start, end = SUMMARY_MARKERS
    changed = []
    for doc in pages:
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        if start not in text or end not in text:
            continue
        table = summary_table(results_dir).strip("\n")
        before, rest = text.split(start, 1)
        shown, after = rest.split(end, 1)
        if shown.strip("\n") == table:
            continue
        with open(path, "w") as f:
            f.write(f"{before}{start}\n{table}\n{end}{after}")
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
    changed += sync_summary()
    print(f"Speed tables copied into {', '.join(changed) or 'nothing (already equal)'}.")


if __name__ == "__main__":
    main()
