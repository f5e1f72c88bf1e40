"""Runs every benchmark of the project and writes the report.

    python benchmarks/run_all.py [--quick] [--processes N] [--only a,b] [--timeout S]
                                 [--args "..." --page NAME]
    python benchmarks/run_all.py --sync-docs | --render

One method: every time ratio is step-level, each side's compiled train
function timed step by step (`sides.step_fn`), interleaved round by
round (`harness.interleaved_step_ratios`). Rows that are not step time
(op counts, peak memory, a norm alone) say what they measure.

Running. `--processes N` (default 1; the published run uses 3) runs the
whole set N times, in N fresh Python processes one after another (never
two at once: they would time each other). Each process imports TensorFlow
once, then imports every `benchmarks/bench_*.py` as a module and calls its
`main(argv)` (`["--quick"]` with `--quick`), with
`keras.backend.clear_session()` after each. A script whose source sets
`OWN_PROCESS = True` (it must configure TensorFlow before it initialises,
or measures its process) runs as its own subprocess instead. A script
that raises, exits non-zero, runs past `--timeout` or writes no JSON is
recorded with the reason, and the next one runs (and the exit status is
1). A script without `--quick` in its source is not run in quick mode
(`bench_distributed`: its own process's start takes much of the budget).

`--args "..."` adds arguments to every script's `argv` (e.g.
`--only targets --args "--models mlp_256x1024_b64,cnn_bn" --page
RESULTS-large`: issue 28's table on the larger models, judged the same
way); `--page NAME` writes `benchmarks/NAME.md` and `out/NAME.json`
instead of RESULTS.md and `out/run.json` (no plot), its speed table
between `<!-- speed-table-NAME:start/end -->` markers, copied into the
docs that have them.

Verdicts. Each script writes JSON to `benchmarks/out/` (`harness.report`;
a script's results are the files it reported, or added to
`harness.WRITTEN`, or, for a script that does not report through the
harness in this process, the JSON files written while it ran):
per row its statistics and target (`"<= 1.05"`; `"<= 1.05 at T=4"` bounds
only rows named `T=4`; `"about 2"` and other words are information). The
statistic judged is the ratio of the two sides' median step
(`harness.interleaved_step_ratios`). Per target row:
"met" when it meets the target in every process, "not met" when in none,
"noisy" when the processes disagree (each process's figure is shown).

Writes `benchmarks/RESULTS.md` (header: date, machine, code, command,
processes, statistic; the "Speed targets" table; the short speed table;
each script's detail), `benchmarks/results.png`,
`benchmarks/out/speed_table.md` (bench_targets' rows: pair, target,
figure, verdict) and copies that table between the
`<!-- speed-table:start -->` / `<!-- speed-table:end -->` markers of
docs/index.md, and the README's short table (`speed_table.summary_table`,
from RESULTS.md, RESULTS-large.md and RESULTS-jax.md) between its
`speed-summary` markers, so that no page shows a figure the latest run
does not (`--sync-docs` copies them again from the pages; `--render`
writes every page again from the last run's `benchmarks/out/run.json`).

Which script measures what (issue 28): `bench_targets` holds the issue's
table (FastGradModel against the keras.Model doing the same work, on five
models); the comparisons with keras.Model that `bench_core`, `bench_steps`
(removed), `bench_embedding` (default), `bench_callbacks` (clip_norm with
three callbacks) and `bench_adaptive_clipping` (on / off) timed before are
its rows now. The
others time what that table does not hold (telemetry, BatchNorm
statistics, callbacks, the noise scale, multi-task merging, the gate,
MirroredStrategy), all step by step.
"""

import argparse
import ast
import contextlib
import glob
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
DOCS_ROOT = ROOT  # where README.md and docs/index.md are
QUICK_BUDGET_S = 300
EXTRA_ARGV = []  # `--args`, split: added to every script's argv
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_page  # noqa: E402
import speed_table  # noqa: E402


# ----------------------------------------------------------------- one process
def discover(only=None):
    """The benchmarks: `bench_*.py` that define `main` (others are modules
    of models the benchmarks share)."""
    scripts = [s for s in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))) if has_main(s)]
    if only:
        scripts = [s for s in scripts if name_of(s) in only]
    return scripts


def name_of(script):
    return os.path.basename(script)[len("bench_") : -len(".py")]


def has_main(script):
    with open(script) as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def describe(script):
    """From the source, without importing it: the docstring's first line,
    whether it has `--quick`, and whether it sets `OWN_PROCESS = True`."""
    with open(script) as f:
        source = f.read()
    tree = ast.parse(source)
    own = any(
        isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "OWN_PROCESS" for t in node.targets)
        and getattr(node.value, "value", None) is True
        for node in tree.body
    )
    doc = ast.get_docstring(tree) or ""
    return (doc.strip().splitlines() or [""])[0], "--quick" in source, own


def json_stamps(out):
    return {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(out, "*.json"))}


class ScriptTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    def expire(signum, frame):
        raise ScriptTimeout(f"timed out after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def in_process(script, argv, log, timeout):
    """Calls the script's `main(argv)` here; returns `None` or the reason
    it failed."""
    name = os.path.basename(script)[: -len(".py")]
    module = sys.modules.get(name)
    if getattr(module, "__file__", None) != script:  # not imported yet (or a namesake)
        spec = importlib.util.spec_from_file_location(name, script)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        return "not run: the script has no `main(argv)`"
    harness = sys.modules.get("harness")
    if hasattr(harness, "load_average"):  # the load when this script starts, not the first
        harness.LOAD_AT_START = harness.load_average()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            with time_limit(timeout):
                code = module.main(argv)
    except ScriptTimeout as error:
        return str(error)
    except SystemExit as error:
        code = error.code
    except Exception:
        traceback.print_exc(file=log)
        log.flush()
        return f"failed: {tail(log.name)}"
    finally:
        if "keras" in sys.modules:
            sys.modules["keras"].backend.clear_session()
    if code not in (None, 0):
        log.flush()
        return f"failed (exit {code}): {tail(log.name)}"
    return None


def own_process(script, argv, log, timeout):
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    try:
        done = subprocess.run(
            [sys.executable, script, *argv],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    log.flush()
    return None if done.returncode == 0 else f"failed (exit {done.returncode}): {tail(log.name)}"


def run_script(script, quick, timeout):
    """Runs one benchmark; returns its record (status, wall time, outputs)."""
    title, has_quick, own = describe(script)
    record = {
        "name": name_of(script),
        "title": title,
        "outputs": {},
        "wall_s": 0.0,
        "own_process": own,
    }
    if quick and not has_quick:
        record["status"] = "not run: the script has no `--quick` option"
        return record
    out = os.path.join(os.path.dirname(script), "out")
    os.makedirs(out, exist_ok=True)
    before = json_stamps(out)
    reported = len(getattr(sys.modules.get("harness"), "WRITTEN", []))
    start = time.perf_counter()
    with open(os.path.join(out, f"{record['name']}.log"), "w") as log:
        run = own_process if own else in_process
        failure = run(script, (["--quick"] if quick else []) + EXTRA_ARGV, log, timeout)
    record["wall_s"] = time.perf_counter() - start
    written = [p for p, stamp in json_stamps(out).items() if before.get(p) != stamp]
    mine = getattr(sys.modules.get("harness"), "WRITTEN", [])[reported:]
    if mine:  # what this script reported (or added to `harness.WRITTEN`)
        written = [p for p in written if p in mine]
    for path in sorted(written):
        with open(path) as f:
            record["outputs"][os.path.basename(path)] = json.load(f)
    if failure:
        record["status"] = failure
    elif not written:
        record["status"] = "ran, but wrote no JSON to benchmarks/out/"
    else:
        record["status"] = "ok"
    print(f"bench_{record['name']}.py: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
    return record


def run_set(scripts, quick, timeout):
    """Every script in this process, one after another."""
    for folder in {os.path.dirname(s) for s in scripts}:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return [run_script(s, quick, timeout) for s in scripts]


def tail(path, lines=3):
    with open(path) as f:
        last = [line.strip() for line in f if line.strip()][-lines:]
    return " / ".join(last)[-400:]


# ----------------------------------------------------------------- N processes
def run_processes(n, quick, only, timeout):
    """`n` fresh processes, one after another; returns `(runs, wall_s)`."""
    runs, walls = [], []
    for p in range(n):
        path = os.path.join(OUT, f"process_{p + 1}.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", path, "--dir", HERE]
        command += ["--timeout", str(timeout)] + (["--quick"] if quick else [])
        command += ["--only", ",".join(sorted(only))] if only else []
        command += ["--args", shlex.join(EXTRA_ARGV)] if EXTRA_ARGV else []
        # (`harness.process_number`: bench_targets alternates its build order)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "FASTGRAD_BENCH_PROCESS": str(p + 1)}
        print(f"process {p + 1} of {n}", flush=True)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env)
        walls.append(time.perf_counter() - start)
        if done.returncode != 0 or not os.path.exists(path):
            runs.append(
                [
                    {
                        "name": "run_all",
                        "title": "the process itself",
                        "outputs": {},
                        "wall_s": walls[-1],
                        "status": f"process {p + 1} failed (exit {done.returncode})",
                    }
                ]
            )
            continue
        with open(path) as f:
            runs.append(json.load(f))
    return runs, walls


def machine_line(runs):
    described = [
        out.get("machine") for records in runs for r in records for out in r["outputs"].values()
    ]
    base = next((m for m in described if m), f"{platform.machine()}, {os.cpu_count()} CPU cores")
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = ""
    return f"{base}; {cpu}; Python {platform.python_version()}" if cpu else base


def git_state():
    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"git {head}" + (" plus uncommitted changes" if dirty else "")


def main(argv=None):
    global HERE, OUT  # --child: the folder it is given
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="each script's quick mode")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes (default 1)")
    parser.add_argument("--only", default="", help="comma-separated names (bench_<name>.py)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per script")
    parser.add_argument("--sync-docs", action="store_true", help="copy RESULTS.md's speed table")
    parser.add_argument(
        "--render", action="store_true", help="write the pages again from out/run.json"
    )
    parser.add_argument("--args", default="", help="more arguments for every script")
    parser.add_argument("--page", default="RESULTS", help="benchmarks/<PAGE>.md (default RESULTS)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one process's records, as JSON
    parser.add_argument("--dir", help=argparse.SUPPRESS)  # where the bench_*.py are
    args = parser.parse_args(argv)
    EXTRA_ARGV[:] = shlex.split(args.args)
    run_json = "run.json" if args.page == "RESULTS" else f"{args.page}.json"
    if args.sync_docs:
        return speed_table.main()
    if args.render:
        with open(os.path.join(OUT, run_json)) as f:
            write_pages(json.load(f))
        return 0
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    timeout = args.timeout or (300 if args.quick else 1800)
    if args.child:
        HERE, OUT = args.dir or HERE, os.path.join(args.dir or HERE, "out")
        records = run_set(discover(only), args.quick, timeout)
        with open(args.child, "w") as f:
            json.dump(records, f)
        return 0
    if args.processes < 1:
        parser.error(f"`--processes` must be >= 1. Received: --processes {args.processes}")
    os.makedirs(OUT, exist_ok=True)
    load_start = os.getloadavg()[0]
    runs, walls = run_processes(args.processes, args.quick, only, timeout)
    command = "python benchmarks/run_all.py" + "".join(
        (" --quick" if args.quick else "")
        + (f" --processes {args.processes}" if args.processes > 1 else "")
        + (f" --only {args.only}" if only else "")
        + (f" --args {shlex.quote(args.args)}" if EXTRA_ARGV else "")
        + (f" --page {args.page}" if args.page != "RESULTS" else "")
    )
    run = {
        "runs": runs,
        "command": command,
        "wall_s": walls,
        "quick": args.quick,
        "machine": machine_line(runs),
        "code": git_state(),
        "load": (load_start, os.getloadavg()[0]),
        "date": results_page.now(),
        "page": args.page,
    }
    with open(os.path.join(OUT, run_json), "w") as f:
        json.dump(run, f)
    write_pages(run)
    ran = [
        r["status"] for records in runs for r in records if not r["status"].startswith("not run")
    ]
    return 0 if all(status == "ok" for status in ran) else 1


def write_pages(run):
    """RESULTS.md, the speed table (copied into the docs) and the plot, from
    a run's records (`--render`: again from `benchmarks/out/run.json`)."""
    runs, walls, page = run["runs"], run["wall_s"], run.get("page", "RESULTS")
    text = results_page.markdown(
        runs,
        run["command"],
        walls,
        run["quick"],
        run["machine"],
        run["code"],
        run["load"],
        QUICK_BUDGET_S,
        run["date"],
        page,
    )
    with open(os.path.join(HERE, f"{page}.md"), "w") as f:
        f.write(text)
    table = speed_table.between_markers(text, page)
    name = "speed_table.md" if page == "RESULTS" else f"speed_table_{page}.md"
    speed_table.write_speed_table(table + "\n", os.path.join(OUT, name))
    changed = speed_table.sync_docs(table, root=DOCS_ROOT, page=page)
    changed += speed_table.sync_summary(HERE, root=DOCS_ROOT)  # the README's short table
    png = results_page.plot(runs, os.path.join(HERE, "results.png")) if page == "RESULTS" else None
    print(
        f"Wrote benchmarks/{page}.md{', ' + png if png else ''} and the speed table"
        f"{' (copied into ' + ', '.join(changed) + ')' if changed else ''}: "
        f"{sum(walls):.0f} s ({', '.join(f'{w:.0f} s' for w in walls)} per process)."
    )


if __name__ == "__main__":
    sys.exit(main())
