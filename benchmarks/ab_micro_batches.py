"""Issue 48's step time: the TensorFlow step before and after its micro-batching change, in one process.

    python benchmarks/ab_micro_batches.py [--quick] [--rounds N] [--pairs a,b]
                                          [--build-order before|after]

Issue 48 (commits c3febfa, fd57dc7) changed the TensorFlow step of
`micro_batches` and of `accumulation_steps`; it allows the step to be
slower than before by at most 3%. Each pair here is one model and option
set, built twice in this process:
- side "after": the current code;
- side "before": the code those commits replaced, recreated while that
  side's train function is traced (a `tf.function` keeps what its trace
  read; nothing else in keras_fastgrad/ changed between 8af9b44, their
  parent, and fd57dc7): in `keras_fastgrad.backend.tensorflow.slicing`,
  `_PARALLEL_ITERATIONS` is 10 (TensorFlow's default, which the slices'
  `tf.while_loop` had), `_unset` is `tf.zeros(shape, tf.float32)` (the
  sums started from zeros) and `_added` the plain `total + cast(g)` of
  every slice (no `tf.cond`); `backend.tensorflow.accumulation.reset`
  empties the window with `tf.zeros_like`. The patches are lifted once
  the side is built.
Each side's trace is read back and printed (the slices' `While` op's
`parallel_iterations`, how the sums start and add, how the window is
emptied), a side that did not trace as its code would is refused, and a
side that traces again after its build (which would trace the current
code) is refused at the end (`train_step_trace_count`).

Timing: bench_targets' method (docs/benchmarks.md, "One method"):
`sides.step_fn` (each side's compiled `train_function` timed step by
step on a repeating `tf.data` pipeline), `harness.interleaved_step_ratios`
(each round runs the two sides in blocks of 4 steps, A B B A ..., the
order flipping from round to round). Per pair, after / before: `median`,
the ratio of the two sides' median step over every round (the figure
judged); `min` and `max`, the spread of the per-round ratios; `best`,
the ratio of each side's fastest round; `mean`, the ratio of the two
sides' total time over every round. With `accumulation_steps=4` only
one step in 4 applies and empties the window (what changed there): the
median step is an accumulating one, `mean` and `best` include the
applying steps.

Verdict (target <= 1.03, in one process): **met** when both the median
and the best-round ratio meet it, **not met** when neither does,
**noisy** when they disagree (`verdicts.check`, `verdicts.verdict`).

Models: bench_step_memory's (its `build`, Adam(1e-4), sparse categorical
cross-entropy from logits): `conv` (64x64x3, Conv2D 16-16-32, batch 128,
activations dominate) and `mlp` (512 -> 4096 -> 4096 -> 512 -> 10, 21.0M
parameters, batch 16). Pairs (`--pairs`, all but the A/A ones by
default): `conv_m2`, `conv_m8`, `mlp_m2`, `mlp_m8` (`micro_batches` 2,
8), `mlp_acc4` (`accumulation_steps=4`); `conv_m8_same`, `mlp_m8_same`:
the current code against itself built alike (A/A: the method's noise on
that model); `conv_m8_serial`, `mlp_m8_serial` (side "serial": the
"before" code with the current `parallel_iterations=1`) / "before": what
the serial loop costs alone; `conv_m8_cond`, `mlp_m8_cond`: "after" /
"serial", what the sums' start from the first slice (a `tf.cond` a
slice) costs. A round is 8 steps a side on `conv`, 16 on `mlp`; 8 rounds
(`--quick`: 2 rounds of 4 steps). `--build-order` (default `before`):
which side of a pair is built first.

Writes benchmarks/out/ab_micro_batches.json.
"""

import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGET = "<= 1.03"
# name: (model, options, numerator side, denominator side)
PAIRS = {
    "conv_m2": ("conv", {"micro_batches": 2}, "after", "before"),
    "conv_m8": ("conv", {"micro_batches": 8}, "after", "before"),
    "mlp_m2": ("mlp", {"micro_batches": 2}, "after", "before"),
    "mlp_m8": ("mlp", {"micro_batches": 8}, "after", "before"),
    "mlp_acc4": ("mlp", {"accumulation_steps": 4}, "after", "before"),
    "conv_m8_same": ("conv", {"micro_batches": 8}, "after", "after"),
    "mlp_m8_same": ("mlp", {"micro_batches": 8}, "after", "after"),
    # (which change costs: the serial loop alone, then the sums' `tf.cond`)
    "conv_m8_serial": ("conv", {"micro_batches": 8}, "serial", "before"),
    "conv_m8_cond": ("conv", {"micro_batches": 8}, "after", "serial"),
    "mlp_m8_serial": ("mlp", {"micro_batches": 8}, "serial", "before"),
    "mlp_m8_cond": ("mlp", {"micro_batches": 8}, "after", "serial"),
}
DEFAULT_PAIRS = [n for n in PAIRS if not n.endswith(("_same", "_serial", "_cond"))]
STEPS = {"conv": 8, "mlp": 16}  # a round's steps a side (whole blocks of 4)
BATCHES = 4  # distinct batches in the repeating pipeline


def build_model(model_name, options):
    """bench_step_memory's model `model_name` as a compiled `FastGradModel`
    with `options`; `(model, x, y, batch)`, `x`, `y` `BATCHES` batches."""
    import keras
    from bench_step_memory import MODELS, build
    from sides import synthetic

    import keras_fastgrad

    model = build(model_name, lambda i, o: keras_fastgrad.FastGradModel(i, o, **options))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    shape, batch = MODELS[model_name]
    x, y = synthetic(shape, 10, batch * BATCHES)
    return model, x, y, batch


@contextlib.contextmanager
def code(side, seen):
    """While active, a step traced is `side`'s ("before": the code that
    c3febfa and fd57dc7 replaced; "after": the current one; "serial":
    "before" with the current `parallel_iterations=1`); `seen` (a
    dict) gets what the trace ran: `starts` (the sums' first values),
    `added` ("cond" or "plain"), `reset` ("run_time_zeros" or
    "zeros_like")."""
    from keras_fastgrad._tf_startup import tf
    from keras_fastgrad.backend.tensorflow import accumulation, slicing

    originals = {
        (slicing, "_PARALLEL_ITERATIONS"): slicing._PARALLEL_ITERATIONS,
        (slicing, "_unset"): slicing._unset,
        (slicing, "_added"): slicing._added,
        (accumulation, "reset"): accumulation.reset,
    }
    seen.update(starts=[], added=set(), reset=set())

    def unset(shape):
        start = (
            tf.zeros(shape, tf.float32) if side != "after" else originals[slicing, "_unset"](shape)
        )
        seen["starts"].append(start)
        return start

    def added(i, sums, grads):
        if side == "after":
            seen["added"].add("cond")
            return originals[slicing, "_added"](i, sums, grads)
        seen["added"].add("plain")
        return [
            [total if g is None else total + tf.cast(g, tf.float32) for total, g in zip(r, row)]
            for r, row in zip(sums, grads)
        ]

    def reset(acc):
        if side == "after":
            seen["reset"].add("run_time_zeros")
            return originals[accumulation, "reset"](acc)
        seen["reset"].add("zeros_like")
        for total in acc.sums:
            total.assign(tf.zeros_like(total))
        acc.normaliser.assign(0.0)
        acc.included.assign(0)

    patches = {
        (slicing, "_PARALLEL_ITERATIONS"): 10 if side == "before" else 1,
        (slicing, "_unset"): unset,
        (slicing, "_added"): added,
        (accumulation, "reset"): reset,
    }
    if originals[slicing, "_PARALLEL_ITERATIONS"] != 1:
        raise RuntimeError(
            "keras_fastgrad.backend.tensorflow.slicing._PARALLEL_ITERATIONS is "
            f"{originals[slicing, '_PARALLEL_ITERATIONS']}, not issue 48's 1: the code "
            "changed since this A/B was written. Fix: update `code` to the new 'after'."
        )
    try:
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name), value in originals.items():
            setattr(owner, name, value)


def traced(seen):
    """What a side's trace ran, in words, from `code`'s record."""
    words = []
    if seen["starts"]:
        graph = seen["starts"][0].graph
        starts = {id(t) for t in seen["starts"]}
        loops = [
            op
            for op in graph.get_operations()
            if op.type in ("While", "StatelessWhile") and any(id(t) in starts for t in op.inputs)
        ]
        iterations = sorted({op.get_attr("parallel_iterations") for op in loops})
        kinds = sorted({t.op.type for t in seen["starts"]})
        words.append(f"slices' loop parallel_iterations={iterations}")
        words.append(f"sums start from {'/'.join(kinds)}, added {'/'.join(sorted(seen['added']))}")
    if seen["reset"]:
        words.append(f"window emptied with {'/'.join(sorted(seen['reset']))}")
    return "; ".join(words)


EXPECTED = {  # (side, micro-batched): what `traced` reads for it
    ("before", True): ("parallel_iterations=[10]", "sums start from ", "added plain"),
    ("after", True): ("parallel_iterations=[1]", "sums start from Empty, added cond"),
    ("serial", True): ("parallel_iterations=[1]", "sums start from ", "added plain"),
    ("serial", False): ("window emptied with zeros_like",),
    ("before", False): ("window emptied with zeros_like",),
    ("after", False): ("window emptied with run_time_zeros",),
}


def built_side(side, model_name, options, steps):
    """One side: its model built and traced under `code(side)`, as a
    `sides.step_fn` of `steps` steps; `(run, model, what it traced)`."""
    from sides import dataset_of, step_fn

    seen = {}
    with code(side, seen):
        model, x, y, batch = build_model(model_name, options)
        run = step_fn(model, dataset_of(x, y, batch), steps)
    what = traced(seen)
    missing = [w for w in EXPECTED[side, "micro_batches" in options] if w not in what]
    if missing:
        raise RuntimeError(
            f"The {side!r} side of {model_name} {options} did not trace as its code would: "
            f"read {what!r}, missing {missing}. Fix: update `code` to the step's current code."
        )
    return run, model, what


def recording(run, times):
    """`run` (a `step_fn`), also appending each step's seconds to `times`."""

    def recorded(count=None):
        seconds = run(count)
        times.extend(seconds)
        return seconds

    recorded.steps = run.steps
    return recorded


def verdict(stats):
    """`met`, `not met` or `noisy` (`TARGET`) from the median and the
    best-round ratio."""
    from verdicts import check
    from verdicts import verdict as over

    return over([check("", stats["median"], TARGET), check("", stats["best"], TARGET)])


def names(value):
    """`--pairs`' names (bench_step_memory's check of a names option)."""
    from bench_step_memory import names as checked_names

    return checked_names(value, PAIRS, "--pairs")


def options(parser):
    parser.add_argument("--pairs", default=",".join(DEFAULT_PAIRS), help=f"of {list(PAIRS)}")
    parser.add_argument("--build-order", choices=("before", "after"), default="before")


def main(argv=None):
    from harness import command_line, interleaved_step_ratios, report

    args, rounds, _, _ = command_line(__doc__, (2, 4), (8, None), argv=argv, extra=options)
    pairs = names(args.pairs)
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"`--rounds` must be an integer >= 1. Received: --rounds={args.rounds}")
    import keras

    results, traces, lines = {}, {}, []
    for name in pairs:
        model_name, model_options, numerator, denominator = PAIRS[name]
        steps = 4 if args.quick else STEPS[model_name]
        order = [numerator, denominator]
        order = order[::-1] if args.build_order == "before" else order
        start, built = time.perf_counter(), {}
        for k, side in enumerate(order):
            built[k if numerator == denominator else side] = built_side(
                side, model_name, model_options, steps
            )
        keys = (0, 1) if numerator == denominator else (numerator, denominator)
        sides = [built[k] for k in keys]
        label = f"{model_name} {', '.join(f'{k}={v}' for k, v in model_options.items())}"
        label += f": {numerator} / {denominator}" + (" (A/A)" if numerator == denominator else "")
        for side, (_, _, what) in zip((numerator, denominator), sides):
            traces.setdefault(label, []).append(f"{side}: {what}")
            print(f"{label} | {side}: {what}", flush=True)
        counts = [model.train_step_trace_count for _, model, _ in sides]
        times = ([], [])
        timed = [recording(run, t) for (run, _, _), t in zip(sides, times)]
        print(f"{label}: built in {time.perf_counter() - start:.0f} s", flush=True)
        stats = interleaved_step_ratios([(label, *timed)], rounds)[label]
        if [model.train_step_trace_count for _, model, _ in sides] != counts:
            raise RuntimeError(
                f"{label}: a side traced its step again after its build (the current code, "
                "not its own). Fix: feed both sides one input signature."
            )
        # (past the untimed round that `interleaved_step_ratios` runs first)
        stats["mean"] = sum(times[0][steps:]) / sum(times[1][steps:])
        stats["steps"] = steps
        stats["verdict"] = "" if numerator == denominator else verdict(stats)
        results[label] = stats
        lines.append(
            f"{label:42s} {stats['median']:7.3f} {stats['min']:7.3f}-{stats['max']:.3f} "
            f"{stats['best']:7.3f} {stats['mean']:7.3f}  "
            + " / ".join(f"{ms:.1f}" for ms in stats["step_ms"])
            + (f"  {TARGET}: {stats['verdict']}" if stats["verdict"] else "")
        )
        keras.backend.clear_session()
    targets = {label: TARGET for label, s in results.items() if s["verdict"]}
    title = (
        f"Issue 48, step time after / before its micro-batching change ({rounds} rounds, "
        f"sides built {args.build_order} first)"
    )
    report(title, results, targets, "ab_micro_batches", entries={"traces": traces})
    print(f"\n{'pair':42s} {'median':>7s} {'rounds':>13s} {'best':>7s} {'mean':>7s}  step ms")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
