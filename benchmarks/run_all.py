"""Runs every benchmark of the project and writes the report.

    python benchmarks/run_all.py [--quick] [--only core,callbacks] [--timeout S]

Every `benchmarks/bench_*.py` runs in its own subprocess, one after the
other (never two at once: they would time each other), with `--quick` when
given. Each writes one JSON to `benchmarks/out/` (`harness.report`); the
files a script wrote during its run are its results. Then this script
writes:

- `benchmarks/RESULTS.md`: per benchmark a table of its ratios (median,
  min, max, rounds, target, pass/fail of the median against the target),
  the machine, the date, the command and the wall times;
- `benchmarks/results.png`: the medians as horizontal bars with min-max
  whiskers and the targets as marks, one panel per benchmark.

A script without `--quick` is not run in quick mode (it could not keep the
quick budget); one that writes no JSON, fails or times out is listed in
RESULTS.md with the reason. Targets are the strings the scripts give:
`"<= 1.05"`, `"< 1 to switch"`, `"<= 1.05 at T=4"` (checked only on rows
whose name holds `T=4`) are checked; others (`"lower is better"`, `"about
2"`) are shown as information.
"""

import argparse
import ast
import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
QUICK_BUDGET_S = 300
TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)(.*)$")
QUALIFIER = re.compile(r"\bat\s+([A-Za-z_]+\s*=\s*[^\s,;)]+)")
MEMORY_WORDS = ("micro", "memory")


# ----------------------------------------------------------------- running
def discover(only=None):
    scripts = sorted(glob.glob(os.path.join(HERE, "bench_*.py")))
    if only:
        scripts = [s for s in scripts if name_of(s) in only]
    return scripts


def name_of(script):
    return os.path.basename(script)[len("bench_") : -len(".py")]


def describe(script):
    """The first line of the script's docstring, and whether it has --quick."""
    with open(script) as f:
        source = f.read()
    doc = ast.get_docstring(ast.parse(source)) or ""
    return (doc.strip().splitlines() or [""])[0], "--quick" in source


def json_stamps():
    return {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(OUT, "*.json"))}


def run_script(script, quick, timeout):
    """Runs one benchmark; returns its record (status, wall time, outputs)."""
    title, has_quick = describe(script)
    record = {
        "script": os.path.basename(script),
        "name": name_of(script),
        "title": title,
        "outputs": {},
        "wall_s": 0.0,
    }
    if quick and not has_quick:
        record["status"] = "not run: the script has no `--quick` option"
        return record
    command = [sys.executable, script] + (["--quick"] if quick else [])
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    os.makedirs(OUT, exist_ok=True)
    before = json_stamps()
    log_path = os.path.join(OUT, f"{record['name']}.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    record["wall_s"] = time.perf_counter() - start
    written = [p for p, stamp in json_stamps().items() if before.get(p) != stamp]
    for path in sorted(written):
        with open(path) as f:
            record["outputs"][os.path.basename(path)] = json.load(f)
    if code is None:
        record["status"] = f"timed out after {timeout} s"
    elif code != 0:
        record["status"] = f"failed (exit {code}): {tail(log_path)}"
    elif not written:
        record["status"] = "ran, but wrote no JSON to benchmarks/out/"
    else:
        record["status"] = "ok"
    print(f"{record['script']}: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
    return record


def tail(path, lines=3):
    with open(path) as f:
        last = [line.strip() for line in f if line.strip()][-lines:]
    return " / ".join(last)[-400:]


# ----------------------------------------------------------------- targets
def check(name, median, target):
    """`"pass"`, `"fail"`, or `""` when the target is not a checkable bound
    for this row."""
    match = TARGET.match(target or "")
    if match is None:
        return ""
    op, bound, rest = match.group(1), float(match.group(2)), match.group(3)
    qualifier = QUALIFIER.search(rest)
    if qualifier and qualifier.group(1).replace(" ", "") not in name.replace(" ", ""):
        return ""  # the bound is for another row (e.g. "at T=4" on a T=2 row)
    ok = {"<=": median <= bound, "<": median < bound, ">=": median >= bound, ">": median > bound}[
        op
    ]
    return "pass" if ok else "fail"


def rows_of(output):
    """(name, stats, target, verdict) per result of one JSON."""
    targets = output.get("targets", {})
    rows = []
    for name, stats in output.get("results", {}).items():
        target = targets.get(name, "")
        verdict = ""
        if isinstance(stats, dict) and isinstance(stats.get("median"), (int, float)):
            verdict = check(name, stats["median"], target)
        rows.append((name, stats, target, verdict))
    return rows


# ----------------------------------------------------------------- report
def markdown(records, command, total_s, quick, machine, load):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{command}` on {date}. All benchmarks took "
        f"**{total_s:.0f} s** of wall time"
        + (
            f" in quick mode (budget: under {QUICK_BUDGET_S} s on 2 cores: "
            f"{'met' if total_s < QUICK_BUDGET_S else 'NOT met'})."
            if quick
            else "."
        ),
        "",
        f"Machine: {machine}. Code: {git_state()}.",
        "",
        "**These figures are from a shared 2-core CPU machine** (no GPU; other "
        f"jobs ran at the same time: load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end), so single rounds are noisy. Each ratio "
        "is the time of the first configuration over the second, measured "
        "side by side in one process, interleaved round by round "
        "(`harness.interleaved_ratios`), which cancels slow moments that hit "
        "both sides; min and max show the spread. A result passes when its "
        "median meets the target; rows without a bound are for information."
        + (" Quick mode runs fewer rounds and steps than a full run." if quick else ""),
        "",
        "![medians with min-max whiskers and targets](results.png)",
        "",
        "| benchmark | script | ratios | pass | fail | wall time | status |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in records:
        rows = [row for out in r["outputs"].values() for row in rows_of(out)]
        verdicts = [row[3] for row in rows]
        lines.append(
            f"| {r['name']} | `{r['script']}` | {len(rows)} | {verdicts.count('pass')} "
            f"| {verdicts.count('fail')} | {r['wall_s']:.0f} s | {r['status']} |"
        )
    for r in records:
        lines += ["", f"## {r['name']}: {r['title']}", ""]
        if r["status"] != "ok":
            lines += [f"Status: {r['status']}.", ""]
        for file_name, out in r["outputs"].items():
            lines += table(file_name, out)
    if not any(any(w in r["name"] for w in MEMORY_WORDS) for r in records):
        lines += [
            "",
            "## Micro-batching memory (issue 6, part 1)",
            "",
            "No benchmark script for it yet (`benchmarks/bench_micro*.py` or "
            "`bench_memory*.py`); its table of peak memory per configuration "
            "will appear here once it exists.",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def table(file_name, out):
    if "results" not in out:  # not written by `harness.report`: show its values
        lines = [f"From `benchmarks/out/{file_name}`:", "", "| name | values |", "|---|---:|"]
        for name, value in out.items():
            values = value if isinstance(value, list) else [value]
            lines.append(f"| {name} | {', '.join(fmt(v) for v in values)} |")
        return lines + [""]
    rows = rows_of(out)
    extra = []
    for _, stats, _, _ in rows:
        if isinstance(stats, dict):
            extra += [
                k for k in stats if k not in ("median", "min", "max", "rounds") and k not in extra
            ]
    header = ["ratio", "median", "min", "max", "rounds"] + extra + ["target", "result"]
    lines = [
        f"From `benchmarks/out/{file_name}`:",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 3) + "---|---|",
    ]
    for name, stats, target, verdict in rows:
        stats = stats if isinstance(stats, dict) else {"median": stats}
        cells = [name] + [fmt(stats.get(k)) for k in header[1:-2]]
        cells += [target or "", {"pass": "pass", "fail": "**FAIL**"}.get(verdict, "")]
        lines.append("| " + " | ".join(cells) + " |")
    others = {k: v for k, v in out.items() if k not in ("machine", "results", "targets")}
    if others:
        lines += [
            "",
            "Also in the JSON:",
            "",
            "```json",
            json.dumps(others, indent=1, default=str)[:3000],
            "```",
        ]
    if out.get("machine"):
        lines += ["", f"Measured on: {out['machine']}."]
    return lines + [""]


def fmt(value):
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def plot(records, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = []
    for r in records:
        rows = [
            row
            for out in r["outputs"].values()
            for row in rows_of(out)
            if isinstance(row[1], dict) and {"median", "min", "max"} <= set(row[1])
        ]
        if rows:
            panels.append((f"{r['name']} ({r['script']})", rows))
    if not panels:
        return None
    heights = [len(rows) + 1.2 for _, rows in panels]
    fig = Figure(figsize=(11, 0.32 * sum(heights) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    colors = {"pass": "tab:green", "fail": "tab:red", "": "tab:gray"}
    for ax, (title, rows) in zip(axes, panels):
        y = list(range(len(rows)))
        medians = [s["median"] for _, s, _, _ in rows]
        errors = [
            [m - s["min"] for m, (_, s, _, _) in zip(medians, rows)],
            [s["max"] - m for m, (_, s, _, _) in zip(medians, rows)],
        ]
        ax.barh(
            y,
            medians,
            xerr=errors,
            color=[colors[v] for *_, v in rows],
            alpha=0.8,
            error_kw={"elinewidth": 1, "capsize": 2},
        )
        for i, (name, _, target, verdict) in enumerate(rows):
            match = TARGET.match(target or "")
            if match and verdict:
                bound = float(match.group(2))
                ax.plot([bound, bound], [i - 0.45, i + 0.45], color="black", lw=2)
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yticks(y, [name for name, *_ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel(
        "ratio (median, whiskers min-max; black mark = target; "
        "green pass, red fail, gray no bound)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def machine_line(records):
    described = [out.get("machine") for r in records for out in r["outputs"].values()]
    base = next((m for m in described if m), f"{platform.machine()}, {os.cpu_count()} CPU cores")
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        pass
    return f"{base}; {cpu}; Python {platform.python_version()}" if cpu else base


def git_state():
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"git {head}" + (" plus uncommitted changes in the working tree" if dirty else "")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"each script's quick mode (all in under {QUICK_BUDGET_S} s)",
    )
    parser.add_argument("--only", default="", help="comma-separated names (bench_<name>.py) to run")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per script (default 300 quick, 1800 full)",
    )
    args = parser.parse_args(argv)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    timeout = args.timeout or (300 if args.quick else 1800)
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    records = [run_script(s, args.quick, timeout) for s in discover(only)]
    total = time.perf_counter() - start
    command = "python benchmarks/run_all.py" + " ".join(
        [""] + (["--quick"] if args.quick else []) + ([f"--only {args.only}"] if only else [])
    )
    text = markdown(
        records, command, total, args.quick, machine_line(records), (load_start, os.getloadavg()[0])
    )
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write(text)
    png = plot(records, os.path.join(HERE, "results.png"))
    print(f"Wrote benchmarks/RESULTS.md{' and ' + png if png else ''} after {total:.0f} s.")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
