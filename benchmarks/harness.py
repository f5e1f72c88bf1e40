"""Side-by-side timing: configurations run interleaved in one process, and
each round's time is divided by the baseline's time of the same round, so a
slow moment of a noisy machine hits both sides of a ratio."""

import json
import os
import platform
import statistics
import time

import numpy as np


def machine():
    import keras
    import tensorflow as tf

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"TF {tf.__version__}, Keras {keras.__version__}, "
        f"GPUs: {len(tf.config.list_physical_devices('GPU'))}"
    )


def command_line(doc, quick, full, models=None, quick_models=None, argv=None, extra=None):
    """The command line every benchmark takes: `--quick`, `--rounds N`
    and, where it has `models` (names), `--models a,b`.

    Args:
        doc: The script's docstring (`--help`).
        quick, full: `(rounds, steps)` of each mode.
        models: Optional list of model names, all run by default.
        quick_models: Optional list, the models `--quick` runs by default.
        argv: The arguments (`main(argv)`; `None`: `sys.argv[1:]`), so
            that `run_all` can call every script's `main` in one process.
        extra: Optional function adding a script's own options to the
            parser.

    Returns:
        `(args, rounds, steps, names)`: `names` the models to run (`[]`
        without `models`).
    """
    import argparse

    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    if models is not None:
        parser.add_argument("--models", default=None, help=f"comma-separated, of {models}")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    rounds, steps = quick if args.quick else full
    names = []
    if models is not None:
        default = quick_models if args.quick and quick_models else models
        names = args.models.split(",") if args.models else list(default)
    return args, args.rounds or rounds, steps, names


def time_call(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_average():
    """The 1-minute load average (how busy the machine was), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


LOAD_AT_START = load_average()


def process_number():
    """Which of `run_all --processes N`'s processes this is (1, 2, ...;
    1 outside `run_all`): the environment's `FASTGRAD_BENCH_PROCESS`."""
    return int(os.environ.get("FASTGRAD_BENCH_PROCESS", "1"))


WRITTEN = []  # the JSON files `report` wrote in this process (for run_all)


def interleaved_ratios(pairs, rounds):
    """Times each (name, numerator_fn, denominator_fn) pair, interleaved.

    Every round runs every function once, alternating the order of the two
    sides from round to round. Returns {name: dict(median, min, max, n)} of
    the per-round ratios numerator / denominator.
    """
    measured = _interleaved(pairs, rounds, lambda fn, size: [time_call(fn)])
    return _summaries(
        {name: [list(map(sum, side)) for side in sides] for name, sides in measured.items()}
    )


def _interleaved(pairs, rounds, measure, block=None):
    """`{name: ([numerator rounds], [denominator rounds])}`, each round a
    list: what `measure(fn, size)` returned (a list) for each block of
    `size` steps of that side (`_blocks`; one whole call, `size=None`, for
    a function without `.steps` or without `block`), the two sides
    alternating A B B A ..., the order flipped from round to round."""
    measured = {name: ([], []) for name, _, _ in pairs}
    for r in range(rounds):
        for name, numerator, denominator in pairs:
            sides = ([], [])
            for j, size in enumerate(_blocks(numerator, denominator, block)):
                first = (j + r) % 2  # 0: the numerator first
                for s in (first, 1 - first):
                    sides[s].extend(measure((numerator, denominator)[s], size))
            measured[name][0].append(sides[0])
            measured[name][1].append(sides[1])
    return measured


def _summaries(measured):
    """The per-round ratios' median, min and max, and the best-of-rounds
    ratio, from `_interleaved`'s round times."""
    results = {}
    for name, times in measured.items():
        values = [num / den for num, den in zip(*times)]
        results[name] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "rounds": len(values),
            # Best of rounds: each side's fastest round (the least disturbed
            # by other work on the machine), divided.
            "best": min(times[0]) / min(times[1]),
        }
    return results


BLOCK = 4  # steps per block of `interleaved_step_ratios`


def interleaved_step_ratios(pairs, rounds, block=BLOCK):
    """Times each (name, numerator, denominator) pair of `step_fn`
    functions, interleaved block by block: a round of a pair runs each
    side's `steps` steps in blocks of `block` steps, the two sides
    alternating A B B A A B ... (the order flips from round to round), so
    both sides meet the same moments of the machine, a few milliseconds
    apart. A side called without `steps` (no `.steps`) runs whole.

    Returns {name: dict(...)}: `median`, the ratio of the two sides' median
    step over every round (the statistic a target row is judged by);
    `min` and `max`, the lowest and highest per-round ratio of median
    steps (the spread across rounds); `rounds`; `best`, the ratio of each
    side's fastest round (its steps' sum); `step_p25`, the ratio of each
    side's 25th-percentile step; `step_ms`, each side's median step in
    milliseconds.

    Why steps and not rounds: one 48-step block per side and round read
    0.82-1.28 on an A/A pair of the 1.5 ms MLP (the machine's jitter
    spans whole blocks), so a median of 6 rounds moved by ~4%; blocks of
    4 steps and the median of all steps read 0.99-1.01 on the same pair.
    """
    for _, numerator, denominator in pairs:  # one untimed round: the first
        numerator()  # timed round after the others' warm-up ran slow
        denominator()
    measured = _interleaved(
        pairs, rounds, lambda fn, size: fn() if size is None else fn(size), block
    )
    results = {}
    for name, (nums, dens) in measured.items():
        steps = [np.concatenate(side) for side in (nums, dens)]
        per_round = [np.median(n) / np.median(d) for n, d in zip(nums, dens)]
        results[name] = {
            "median": float(np.median(steps[0]) / np.median(steps[1])),
            "min": float(min(per_round)),
            "max": float(max(per_round)),
            "rounds": len(per_round),
            # Best of rounds: each side's fastest round (the least disturbed
            # by other work on the machine), divided.
            "best": float(min(map(sum, nums)) / min(map(sum, dens))),
            "step_p25": float(np.percentile(steps[0], 25) / np.percentile(steps[1], 25)),
            "step_ms": [float(np.median(side)) * 1e3 for side in steps],
        }
    return results


def _blocks(numerator, denominator, block):
    """A round's block sizes in steps; `[None]` (one whole call of each
    side) without `block` or when a side has no `.steps`."""
    steps = {getattr(fn, "steps", None) for fn in (numerator, denominator)}
    if block is None or None in steps:
        return [None]
    if len(steps) != 1:
        raise ValueError(
            "The two sides of a pair must run as many steps a round. "
            f"Received: {sorted(steps)} steps."
        )
    (total,) = steps
    return [block] * (total // block) + ([total % block] if total % block else [])


def report(title, results, targets, out_name, entries=None):
    """Prints a table and writes JSON to benchmarks/out/<out_name>.json
    (`entries`: a dict of more entries for it)."""
    load = {"at_start": LOAD_AT_START, "at_end": load_average()}
    print(f"\n{title}\n{machine()}")
    print(
        f"1-minute load average: {load['at_start']} when the script started, "
        f"{load['at_end']} at the end (the benchmark itself keeps about 1-2 of "
        f"{os.cpu_count()} cores busy; more means other work shared the machine)"
    )
    p25 = any("step_p25" in s for s in results.values())
    extra = f" {'p25':>7s}" if p25 else ""
    print(f"{'ratio':58s} {'median':>7s} {'min':>7s} {'max':>7s} {'best':>7s}{extra}  target")
    for name, s in results.items():
        target = targets.get(name, "")
        best = f"{s['best']:7.3f}" if "best" in s else f"{'':7s}"
        extra = f" {s['step_p25']:7.3f}" if "step_p25" in s else f" {'':7s}" if p25 else ""
        print(
            f"{name:58s} {s['median']:7.3f} {s['min']:7.3f} {s['max']:7.3f} {best}{extra}  {target}"
        )
    out_dir = os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    WRITTEN.append(os.path.join(out_dir, f"{out_name}.json"))
    with open(WRITTEN[-1], "w") as f:
        json.dump(
            {
                "machine": machine(),
                "load_average": load,
                **(entries or {}),
                "results": results,
                "targets": targets,
            },
            f,
            indent=2,
        )
