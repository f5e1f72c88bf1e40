"""Verdicts over processes, for `run_all.py`: each target row met, not met or
noisy, from the statistic of each process.

A record is one script's run in one process (`run_all.run_set`): its name,
title, status, wall time and `outputs` (the JSONs it wrote). `runs` is one
list of records per process.
"""

import re

TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)(.*)$")
QUALIFIER = re.compile(r"\bat\s+([A-Za-z_]+\s*=\s*[^\s,;)]+)")
STATISTIC = (
    "the ratio of the two sides' median step (`median`: both sides' compiled train "
    "step timed step by step, interleaved in blocks of 4 steps, the order alternating; "
    "`harness.interleaved_step_ratios`)"
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
