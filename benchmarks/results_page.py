"""`benchmarks/RESULTS.md` and `benchmarks/results.png` from `run_all.py`'s
records (one list per process; see `verdicts.py`): the header, the
"Speed targets" over processes, the speed table, each script's detail.
"""

import datetime
import json
import statistics

from speed_table import markers, speed_table
from verdicts import STATISTIC, TARGET, fmt, per_process, rows


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def markdown(
    runs, command, wall_s, quick, machine, code, load, budget_s, date=None, page="RESULTS"
):
    """`RESULTS.md` (or `<page>.md`): header, the speed targets over
    processes, then each script's detail."""
    start, end = markers(page)
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
        "## Speed table (docs/index.md; the README's short table: speed_table.summary_table)",
        "",
        start,
        speed_table(runs, header).strip("\n"),
        end,
        "",
        *(
            ["![medians with min-max whiskers and targets](results.png)", ""]
            if page == "RESULTS"
            else []
        ),
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
