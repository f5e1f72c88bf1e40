"""The pages `run_all.py` writes from its processes' records: verdicts over
processes, `RESULTS.md`, the short speed table and its copies in the docs.

    python benchmarks/results_page.py   # copy the speed table into the docs

A record is one script's run in one process (`run_all.run_set`): its name,
title, status, wall time and `outputs` (the JSONs it wrote). `runs` is one
list of records per process. Stand-alone, this copies the speed table of
`benchmarks/RESULTS.md` between the markers in README.md and docs/index.md.
"""

import datetime
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = ("README.md", os.path.join("docs", "index.md"))
START, END = "<!-- speed-table:start -->", "<!-- speed-table:end -->"
TARGETS_SCRIPT = "targets"  # bench_targets.py: issue 28's table, the docs' speed table
TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)(.*)$")
QUALIFIER = re.compile(r"\bat\s+([A-Za-z_]+\s*=\s*[^\s,;)]+)")
STATISTIC = (
    "the median of the per-round ratios (`median`: each round times both sides' "
    "compiled train step, interleaved, the order alternating; `harness.interleaved_step_ratios`)"
)


def check(name, value, target):
    """`"pass"`, `"fail"`, or `""` when `target` is not a checkable bound for
    this row (e.g. "about 2", or "<= 1.05 at T=4" on a row of T=2)."""
    match = TARGET.match(target or "")
    if match is None:
        return ""
    op, bound, rest = match.group(1), float(match.group(2)), match.group(3)
    qualifier = QUALIFIER.search(rest)
    if qualifier and qualifier.group(1).replace(" ", "") not in name.replace(" ", ""):
        return ""
    ok = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound}
    return "pass" if ok[op] else "fail"


def verdict(checks):
    """Over processes: "met" when every process meets the target, "not met"
    when none does, "noisy" when they disagree; `""` without a bound."""
    checks = [c for c in checks if c]
    if not checks:
        return ""
    if all(c == "pass" for c in checks):
        return "met"
    if all(c == "fail" for c in checks):
        return "not met"
    return "noisy"


def kind(stats):
    """What a row measures: step-level time, or something else (labelled)."""
    if not isinstance(stats, dict):
        return "value"
    if "step_p25" in stats:
        return "step time"
    return stats.get("kind", "not step time")


def rows(runs):
    """`{(script, file, row): row}` over processes, in first-seen order; a
    row holds its target, kind and each process's stats (`None` where that
    process has no figure)."""
    table = {}
    for p, records in enumerate(runs):
        for record in records:
            for file_name, out in record["outputs"].items():
                targets = out.get("targets", {})
                for name, stats in out.get("results", {}).items():
                    key = (record["name"], file_name, name)
                    row = table.setdefault(
                        key,
                        {"target": targets.get(name, ""), "kind": kind(stats), "stats": {}},
                    )
                    row["stats"][p] = stats if isinstance(stats, dict) else {"median": stats}
    for (_, _, name), row in table.items():
        figures = [s.get("median") for s in row["stats"].values()]
        row["figures"] = [f for f in figures if isinstance(f, (int, float))]
        row["verdict"] = verdict([check(name, f, row["target"]) for f in row["figures"]])
    return table


def fmt(value, digits=3):
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return ", ".join(fmt(v, digits) for v in value)
    return str(value)


def per_process(row, key, processes):
    return " / ".join(fmt(row["stats"].get(p, {}).get(key)) or "-" for p in range(processes))


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


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def markdown(runs, command, wall_s, quick, machine, code, load, budget_s, date=None):
    """`RESULTS.md`: header, the speed targets over processes, then each
    script's detail."""
    n = len(runs)
    date = date or now()
    table = rows(runs)
    header = (
        f"Measured {date} on {machine}, code {code}, by `{command}` "
        f"({n} process{'es' if n > 1 else ''}). Figure: {STATISTIC.split(' (')[0]}"
        + (", the median over processes (their range)." if n > 1 else ".")
    )
    lines = [
        "# Benchmark results",
        "",
        f"- Date: {date}",
        f"- Machine: {machine}; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (the benchmarks keep 1-2 cores busy; more "
        "means other work shared the machine)",
        f"- Code: {code}",
        f"- Command: `{command}`",
        f"- Processes: {n}, one after another, each running every script once "
        f"(wall time {', '.join(f'{w:.0f} s' for w in wall_s)}"
        + (
            f"; quick budget {budget_s} s per process: "
            f"{'met' if max(wall_s, default=0) <= budget_s else 'NOT met'})"
            if quick
            else ")"
        ),
        f"- Statistic: {STATISTIC}. A target row is **met** when the statistic "
        "meets the target in every process, **not met** when in none, **noisy** "
        "when the processes disagree (each process's figure is shown). `p25` "
        "(each side's 25th-percentile step) and `best` (each side's best round) "
        "are shown beside it, not judged.",
        "",
        "## Speed targets",
        "",
        "Step-time ratios with a target; figures per process, separated by `/`.",
        "",
        "| row | target | median | p25 | best | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    others = []
    for (script, _, name), row in table.items():
        if not row["verdict"]:
            continue
        if row["kind"] != "step time":
            others.append((script, name, row))
            continue
        lines.append(
            f"| {script}: {name} | {row['target']} | {per_process(row, 'median', n)} "
            f"| {per_process(row, 'step_p25', n)} | {per_process(row, 'best', n)} "
            f"| {row['verdict']} |"
        )
    if others:
        lines += [
            "",
            "## Other targets (not step time)",
            "",
            "| row | measures | target | median | verdict |",
            "|---|---|---|---:|---|",
        ]
        for script, name, row in others:
            lines.append(
                f"| {script}: {name} | {row['kind']} | {row['target']} "
                f"| {per_process(row, 'median', n)} | {row['verdict']} |"
            )
    lines += [
        "",
        "## Speed table (README and docs/index.md)",
        "",
        START,
        speed_table(runs, header).strip("\n"),
        END,
        "",
        "![medians with min-max whiskers and targets](results.png)",
        "",
        "## Scripts",
        "",
        "| script | status per process | wall time per process |",
        "|---|---|---|",
    ]
    for name in dict.fromkeys(r["name"] for records in runs for r in records):
        mine = [next((r for r in records if r["name"] == name), None) for records in runs]
        statuses = " / ".join(r["status"] if r else "-" for r in mine)
        walls = " / ".join(f"{r['wall_s']:.0f} s" if r else "-" for r in mine)
        lines.append(f"| `bench_{name}.py` | {statuses} | {walls} |")
    for record in runs[0] if runs else []:
        lines += ["", f"## {record['name']}: {record['title']}", ""]
        keys = [k for k in table if k[0] == record["name"]]
        for file_name in dict.fromkeys(k[1] for k in keys):
            lines += detail(file_name, [(k[2], table[k]) for k in keys if k[1] == file_name], n)
            lines += extras(record["outputs"].get(file_name, {}))
    return "\n".join(lines).rstrip() + "\n"


def detail(file_name, named_rows, n):
    lines = [
        f"From `benchmarks/out/{file_name}` ({'per process, ' if n > 1 else ''}separated by `/`):",
        "",
        "| ratio | measures | median | p25 | best | min | max | rounds | target | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, row in named_rows:
        lows = [s.get("min") for s in row["stats"].values() if s.get("min") is not None]
        highs = [s.get("max") for s in row["stats"].values() if s.get("max") is not None]
        lines.append(
            f"| {name} | {row['kind']} | {per_process(row, 'median', n)} "
            f"| {per_process(row, 'step_p25', n)} | {per_process(row, 'best', n)} "
            f"| {fmt(min(lows)) if lows else ''} | {fmt(max(highs)) if highs else ''} "
            f"| {per_process(row, 'rounds', n)} | {row['target']} | {row['verdict']} |"
        )
    return lines + [""]


def extras(out):
    if "results" not in out:  # not written by `harness.report`: its values
        lines = ["| name | values |", "|---|---:|"]
        for name, value in out.items():
            lines.append(f"| {name} | {fmt(value if isinstance(value, list) else [value])} |")
        return lines + [""]
    rest = {k: v for k, v in out.items() if k not in ("machine", "results", "targets")}
    if not rest:
        return []
    return [
        "Also in the JSON (first process):",
        "",
        "```json",
        json.dumps(rest, indent=1)[:2000],
        "```",
        "",
    ]


def plot(runs, path):
    """Per script, each row's median over processes as a bar, whiskers the
    min and max of every round of every process, the target as a mark."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = {}
    for (script, _, name), row in rows(runs).items():
        stats = list(row["stats"].values())
        if row["figures"] and all("min" in s and "max" in s for s in stats):
            median = statistics.median(row["figures"])
            low, high = min(s["min"] for s in stats), max(s["max"] for s in stats)
            panels.setdefault(script, []).append((name, median, low, high, row))
    if not panels:
        return None
    heights = [len(p) + 1.2 for p in panels.values()]
    fig = Figure(figsize=(11, 0.32 * sum(heights) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    colors = {"met": "tab:green", "not met": "tab:red", "noisy": "tab:orange", "": "tab:gray"}
    for ax, (script, bars) in zip(axes[:, 0], panels.items()):
        y = list(range(len(bars)))
        ax.barh(
            y,
            [b[1] for b in bars],
            xerr=[[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]],
            color=[colors[b[4]["verdict"]] for b in bars],
            alpha=0.8,
            error_kw={"elinewidth": 1, "capsize": 2},
        )
        for i, (*_, row) in enumerate(bars):
            match = TARGET.match(row["target"] or "")
            if match and row["verdict"]:
                bound = float(match.group(2))
                ax.plot([bound, bound], [i - 0.45, i + 0.45], color="black", lw=2)
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yticks(y, [b[0] for b in bars], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"bench_{script}.py", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel(
        "median over processes (whiskers: min-max of all rounds; black mark: target; "
        "green met, red not met, orange noisy, gray no bound)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main():
    with open(os.path.join(HERE, "RESULTS.md")) as f:
        table = between_markers(f.read())
    if table is None:
        sys.exit(f"benchmarks/RESULTS.md has no {START} ... {END}: run benchmarks/run_all.py")
    changed = sync_docs(table)
    print(f"Speed table copied into {', '.join(changed) or 'nothing (already equal)'}.")


if __name__ == "__main__":
    main()
