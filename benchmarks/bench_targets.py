"""Issue 28's target table: FastGradModel's step against the keras.Model that does the same work.

    python benchmarks/bench_targets.py [--quick] [--models a,b] [--rows a,b] [--rounds N]
                                       [--xla] [--mixed] [--cpu] [--markdown FILE]
                                       [--build-order alternate|listed|reversed]

Every ratio is step-level (`sides.step_fn`: each side's compiled
`train_function` timed step by step on a repeating `tf.data` pipeline;
`harness.interleaved_step_ratios`: each round runs the two sides in
blocks of 4 steps, alternating A B B A ...; per row `median`, the ratio
of the two sides' median step over every round (the figure judged),
`min` and `max` of the per-round ratios, the ratio of each side's best
round and `p25`, the ratio of each side's 25th-percentile step). Each model is built once per side, and a
side that appears in two rows is one step function timed in both.
`--build-order` (default `alternate`): the sides are built in the rows'
order in odd-numbered processes of `run_all --processes N` (and outside
it) and in the reverse order in even-numbered ones, so that a bias of
the order sides are built in (an A/A pair once read 0.90-0.93 in all
three processes, its second-built side faster) falls on both sides of
every ratio across processes; `listed` or `reversed` fixes it.

Rows (`--rows`, keys in brackets) and targets:
- [gated] default (safe) / keras.Model with its update gated on every
  gradient finite (`anchors.GatedModel`)                         <= 1.03
- [ungated] default / keras.Model: reported beside it (the gate's cost,
  `bench_gate.py`); on the 1M-row Embedding                      <= 1.05
- [unsafe] skip_nonfinite=False / keras.Model                     <= 1.03
- [acc_unsafe] accumulation_steps=4, skip_nonfinite=False /
  optimizer(gradient_accumulation_steps=4)                        <= 1.02
- [acc] accumulation_steps=4 (safe) / the same Keras accumulation
  with the gate of `gated`                                       <= 1.03
- [clip] clip_norm=1 / optimizer(global_clipnorm=1)               <= 1.05
- [clip_gated] clip_norm=1 / the same Keras clipping with the gate of
  `gated` (the like-for-like anchor: `clip` against ungated Keras
  pays the gate too)                                              <= 1.05
- [clip_unsafe] clip_norm=1, skip_nonfinite=False / the ungated Keras
  clipping: `clip` without the gate                               <= 1.05
- [callbacks] clip_norm=1 with GradientNormLogger, NonFiniteGuard and
  TapeVariableCounter / optimizer(global_clipnorm=1): the callbacks
  are attached to the `fit` that builds the train function, so the
  telemetry they switch on is in the timed step (their per-batch
  Python work in `fit` is not)                                   <= 1.06
- [callbacks_gated] the same / the gated Keras clipping           <= 1.06
- [callbacks_logs], [callbacks_logs_gated] the same / Keras' clipping
  (ungated, gated) returning as many more log keys (5), each read from a
  variable it assigns in the step (`anchors.GatedModel(extra_logs=5)`):
  the anchor that does the same work. Keras' TensorFlow train function
  unpacks its outputs on the host at every call (a
  `tf.experimental.Optional`), a cost per log key that `keras.Model`
  pays alike                                                      <= 1.06
- [logs_cost] Keras' clipping with those 5 log keys / without: what the
  keys cost the anchor itself (reported)
- [callbacks_own] clip_norm=1 with the three callbacks / clip_norm=1
  alone: what the callbacks add to the step (reported; `step ms`
  shows it in milliseconds, a fixed cost per step: five more outputs
  and a few variable reads)
- [agc] clip_adaptive=0.01 / default: <= 1.03 on Conv2D+BN and the
  Transformer, <= 1.06 on the MLPs (their memory-traffic floor)
- [same], [acc_same] keras.Model / a second keras.Model built alike (and
  the same for Keras' accumulation): an A/A pair, no target. Both sides do
  the same work, so how far its ratios stray from 1.000 across rounds and
  processes is the method's own noise on that model: a target margin
  inside it cannot be judged there.

Models (`--models`): `mlp_64x256_b64` (64 -> 3 x 256 -> 10, batch 64,
Adam, ~1.5 ms a step on 2 cores), `mlp_256x1024_b64` (256 -> 3 x 1024
-> 10, batch 64, Adam, ~14 ms), `cnn_bn` (bench_core's Conv2D +
BatchNorm, 28x28x1, batch 128, Adam), `transformer` (token + position
embeddings, vocab 1000, sequence 32, width 32, 2 blocks of 4-head
attention + LayerNorm + FFN 32 -> 64 -> 32, mean-pooled, 10 classes,
batch 32, Adam) and `embedding_1m` (bench_embedding's recommender: a 1M x
32 table, sparse gradients, SGD, "mse", batch 32). A round is 48 steps
times the model's scale (2, 0.5, 0.25, 1, 1: about the same time on
each). The full mode runs every row on every model (no `agc` on the
1M-row table: the issue sets no target there), 12 rounds (16 rounds took
1270 s of CPU time, 32 minutes on a busy 2-core machine). `--quick`
(about 2 minutes on 2 idle cores): every row on `mlp_64x256_b64`,
`gated`, `agc` and `same` on `transformer`, `gated`, `ungated` and
`same` on `embedding_1m`, 4 rounds of the full mode's steps (384 steps a
side on the MLP, 192 on the others; 5 rounds took `run_all --quick` to
297-324 s a process, past its 300 s).

GPU (`gpu_check.sh`): `--xla` compiles both sides with
`jit_compile=True`; `--mixed` runs both under the `mixed_float16` policy,
the Keras side with `keras.optimizers.LossScaleOptimizer` (which gates its
own update on finite gradients, so there the `gated` and `acc` anchors
are keras.Model with it) and FastGradModel with its own loss scaling;
rows `gated`, `acc`, `clip` only (the others need `float32` to mean the
same). With a GPU each timed step ends by reading the loss (the step has
finished, as when `fit` hands logs to a callback). `--cpu` runs on the CPU
even with a GPU present and refuses `--mixed` (a GPU-only mode).
`--markdown FILE` appends the table to FILE.

Writes benchmarks/out/targets.json (`targets_xla`, `targets_mixed`,
`targets_xla_mixed` for the GPU modes).
"""

import argparse
import contextlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from anchors import keras_model  # noqa: E402
from bench_core import cnn_bn, dense_stack  # noqa: E402
from bench_embedding import data as embedding_data  # noqa: E402
from bench_embedding import recommender  # noqa: E402
from harness import command_line, interleaved_step_ratios, machine, process_number, report  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402
from keras_fastgrad import callbacks as fg_callbacks  # noqa: E402

VOCAB, LENGTH, WIDTH = 1000, 32, 32
STEPS = 48  # whole windows of 4


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, vocab, length, width, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, width)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


def transformer(cls, **options):
    """A small Transformer encoder classifier (2 blocks)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = TokenAndPosition(VOCAB, LENGTH, WIDTH)(inputs)
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(4, WIDTH // 4)(h, h)
        h = keras.layers.LayerNormalization()(h + attended)
        fed = keras.layers.Dense(2 * WIDTH, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(WIDTH)(fed))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(10)(h), **options)


def classes(shape, dtype="float32"):
    def data(n):
        if dtype == "int32":
            rng = np.random.default_rng(0)
            x = rng.integers(0, VOCAB, size=(n, *shape)).astype("int32")
            return x, rng.integers(0, 10, size=(n,)).astype("int32")
        return synthetic(shape, 10, n)

    return data


def sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def adam(**options):
    return keras.optimizers.Adam(**options)


def sgd(**options):
    return keras.optimizers.SGD(0.01, **options)


# name: (label, build, data(n), batch, loss(), optimizer(**options), steps
# as a multiple of STEPS: about the same time per round on every model)
MODELS = {
    "mlp_64x256_b64": ("MLP 64-3x256-10", dense_stack(64, 256), classes((64,)), 64, sce, adam, 2),
    "mlp_256x1024_b64": (
        "MLP 256-3x1024-10",
        dense_stack(256, 1024),
        classes((256,)),
        64,
        sce,
        adam,
        0.5,
    ),
    "cnn_bn": ("Conv2D+BN", cnn_bn, classes((28, 28, 1)), 128, sce, adam, 0.25),
    "transformer": ("Transformer", transformer, classes((LENGTH,), "int32"), 32, sce, adam, 1),
    "embedding_1m": ("1M-row Embedding", recommender, embedding_data, 32, lambda: "mse", sgd, 1),
}

# side: ("fg" or "gated" or "keras", model options, optimizer options, callbacks)
SIDES = {
    "default": ("fg", {}, {}, False),
    "unsafe": ("fg", {"skip_nonfinite": False}, {}, False),
    "acc": ("fg", {"accumulation_steps": 4}, {}, False),
    "acc_unsafe": ("fg", {"accumulation_steps": 4, "skip_nonfinite": False}, {}, False),
    "clip": ("fg", {"clip_norm": 1.0}, {}, False),
    "clip_unsafe": ("fg", {"clip_norm": 1.0, "skip_nonfinite": False}, {}, False),
    "clip_callbacks": ("fg", {"clip_norm": 1.0}, {}, True),
    "agc": ("fg", {"clip_adaptive": 0.01}, {}, False),
    "keras": ("keras", {}, {}, False),
    "keras_gated": ("gated", {}, {}, False),
    "keras_twin": ("keras", {}, {}, False),
    "keras_acc": ("keras", {}, {"gradient_accumulation_steps": 4}, False),
    "keras_acc_twin": ("keras", {}, {"gradient_accumulation_steps": 4}, False),
    "keras_acc_gated": ("gated", {}, {"gradient_accumulation_steps": 4}, False),
    "keras_clip": ("keras", {}, {"global_clipnorm": 1.0}, False),
    "keras_clip_gated": ("gated", {}, {"global_clipnorm": 1.0}, False),
    # Keras' clipping returning as many more log keys as the callbacks add
    "keras_clip_logs": ("keras_logs", {}, {"global_clipnorm": 1.0}, False),
    "keras_clip_logs_gated": ("gated_logs", {}, {"global_clipnorm": 1.0}, False),
}

# The log keys the three callbacks switch on (`grad_norm`, the three
# `nonfinite_*`, `tape_variables`): checked when their side is built.
CALLBACK_LOG_KEYS = 5

# row: (pair, numerator side, denominator side, target; `target_of` for
# the ones that depend on the model)
ROWS = {
    "gated": (
        "default / keras.Model gated on finite gradients",
        "default",
        "keras_gated",
        "<= 1.03",
    ),
    "ungated": ("default / keras.Model (not gated)", "default", "keras", None),
    "unsafe": ("skip_nonfinite=False / keras.Model", "unsafe", "keras", "<= 1.03"),
    "acc_unsafe": (
        "accumulation_steps=4, skip_nonfinite=False / gradient_accumulation_steps=4",
        "acc_unsafe",
        "keras_acc",
        "<= 1.02",
    ),
    "acc": (
        "accumulation_steps=4 / gradient_accumulation_steps=4 gated",
        "acc",
        "keras_acc_gated",
        "<= 1.03",
    ),
    "clip": ("clip_norm=1 / global_clipnorm=1", "clip", "keras_clip", "<= 1.05"),
    "clip_gated": (
        "clip_norm=1 / global_clipnorm=1 gated",
        "clip",
        "keras_clip_gated",
        "<= 1.05",
    ),
    "clip_unsafe": (
        "clip_norm=1, skip_nonfinite=False / global_clipnorm=1",
        "clip_unsafe",
        "keras_clip",
        "<= 1.05",
    ),
    "callbacks": (
        "clip_norm=1 + 3 callbacks / global_clipnorm=1",
        "clip_callbacks",
        "keras_clip",
        "<= 1.06",
    ),
    "callbacks_gated": (
        "clip_norm=1 + 3 callbacks / global_clipnorm=1 gated",
        "clip_callbacks",
        "keras_clip_gated",
        "<= 1.06",
    ),
    "callbacks_own": ("clip_norm=1 + 3 callbacks / clip_norm=1", "clip_callbacks", "clip", None),
    "callbacks_logs": (
        "clip_norm=1 + 3 callbacks / global_clipnorm=1 with 5 log keys",
        "clip_callbacks",
        "keras_clip_logs",
        "<= 1.06",
    ),
    "callbacks_logs_gated": (
        "clip_norm=1 + 3 callbacks / global_clipnorm=1 gated with 5 log keys",
        "clip_callbacks",
        "keras_clip_logs_gated",
        "<= 1.06",
    ),
    "logs_cost": (
        "global_clipnorm=1 with 5 log keys / global_clipnorm=1 (Keras' cost per key)",
        "keras_clip_logs",
        "keras_clip",
        None,
    ),
    "agc": ("clip_adaptive=0.01 / default", "agc", "default", "<= 1.03"),
    "same": ("keras.Model / keras.Model alike (A/A: the noise)", "keras_twin", "keras", None),
    "acc_same": (
        "gradient_accumulation_steps=4 / the same alike (A/A: the noise)",
        "keras_acc_twin",
        "keras_acc",
        None,
    ),
}


def target_of(row, model):
    if row == "ungated" and model == "embedding_1m":
        return "<= 1.05"  # "in every run"
    if row == "agc" and model.startswith("mlp"):
        return "<= 1.06"  # the dense MLP's memory-traffic floor
    return ROWS[row][3]


MIXED_ROWS = ("gated", "acc", "clip")
QUICK = {
    "mlp_64x256_b64": list(ROWS),
    "transformer": ["gated", "agc", "same"],
    "embedding_1m": ["gated", "ungated", "same"],
}


def rows_of(model, args):
    if args.rows:
        keys = args.rows.split(",")
    elif args.quick and not args.models:
        keys = QUICK[model]
    else:
        keys = [k for k in ROWS if not (k == "agc" and model == "embedding_1m")]
    unknown = sorted(set(keys) - set(ROWS))
    if unknown:
        raise ValueError(
            f"`--rows` must name rows of {list(ROWS)}. Received: {unknown}. "
            "Fix: pick from that list."
        )
    return [k for k in keys if k in MIXED_ROWS] if args.mixed else keys


def three_callbacks():
    return [
        fg_callbacks.GradientNormLogger(),
        fg_callbacks.NonFiniteGuard("raise"),
        fg_callbacks.TapeVariableCounter(),
    ]


def steps_on(model_name, steps=STEPS):
    """The steps of a round on `model_name`: `steps` scaled by the model's
    factor (`MODELS`), in whole blocks of 4."""
    return max(4, int(steps * MODELS[model_name][6]) // 4 * 4)


def model_data(model_name):
    """`model_name`'s data: 16 batches of its batch size, as a dataset."""
    _, _, data_of, batch, *_ = MODELS[model_name]
    return dataset_of(*data_of(batch * 16), batch)


class GraphMode:
    """The options `timed_side` reads, as the diagnosis tools run it: graph
    mode (no XLA), float32."""

    xla = mixed = False


def two_side_parser(doc, model, sides):
    """The parser of a diagnosis tool that compares two sides
    (`op_profile.py`, `instance_spread.py`, `executed_nodes.py`,
    `step_phases.py`): `--model` (a key of `MODELS`, default `model`) and
    `--sides` (default `sides`); read the sides with `parsed_sides`."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=model, choices=list(MODELS))
    parser.add_argument("--sides", default=sides)
    return parser


def parsed_sides(parser, args):
    """`args.sides` (parsed by `parser`, a `two_side_parser`) as
    `two_sides`' list, its default the example of the error."""
    return two_sides(args.sides, parser.get_default("sides"))


def two_sides(text, example):
    """`--sides` of a diagnosis tool (`two_side_parser`): two keys of
    `SIDES`, comma-separated, as a list."""
    sides = text.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if len(sides) != 2 or unknown:
        raise ValueError(
            f"`--sides` must name two keys of bench_targets.SIDES {list(SIDES)}. "
            f"Received: {text!r}. Fix: e.g. `--sides {example}`."
        )
    return sides


def timed_side(side, model_name, args, steps, data):
    """`step_fn` of one side on one model, built and compiled here."""
    _, build, _, _, loss, optimizer, _ = MODELS[model_name]
    kind, options, optimizer_options, with_callbacks = SIDES[side]
    if args.mixed and kind.startswith("gated"):  # LossScaleOptimizer gates already
        kind = kind.replace("gated", "keras")
    if kind == "fg":
        model = build(keras_fastgrad.FastGradModel, **options)
        model.compile(optimizer=optimizer(), loss=loss(), jit_compile=args.xla)
    else:
        model = keras_model(
            build,
            kind.startswith("gated"),
            optimizer(**optimizer_options),
            loss(),
            args.xla,
            args.mixed,
            extra_logs=CALLBACK_LOG_KEYS if kind.endswith("_logs") else 0,
        )
    callbacks = three_callbacks() if with_callbacks else []
    # (`step_fn` reads each step's loss when a GPU is present: timed to its end)
    run = step_fn(model, data, steps, callbacks=callbacks)
    if with_callbacks and len(model.fastgrad_step_state.log_keys) != CALLBACK_LOG_KEYS:
        raise RuntimeError(
            f"The three callbacks switch on {sorted(model.fastgrad_step_state.log_keys)}: "
            f"set CALLBACK_LOG_KEYS to their number (now {CALLBACK_LOG_KEYS})."
        )
    return run


def build_order(args):
    """`--build-order`, `alternate` resolved: the rows' order in odd
    processes of `run_all`, the reverse in even ones (`harness.process_number`)."""
    if args.build_order != "alternate":
        return args.build_order
    return "listed" if process_number() % 2 else "reversed"


def mode_suffix(args):
    return ("_xla" if args.xla else "") + ("_mixed" if args.mixed else "")


def measure(model_name, args, rounds, steps):
    """Every selected row on one model: `(results, targets)`."""
    label = MODELS[model_name][0]
    steps = steps_on(model_name, steps)
    data = model_data(model_name)
    keys = rows_of(model_name, args)
    order = list(dict.fromkeys(side for key in keys for side in ROWS[key][1:3]))
    if build_order(args) == "reversed":
        order.reverse()
    sides, start = {}, time.perf_counter()
    for side in order:
        sides[side] = timed_side(side, model_name, args, steps, data)
    print(
        f"{label}: {len(sides)} sides built in {time.perf_counter() - start:.0f} s "
        f"({build_order(args)} order)",
        flush=True,
    )
    mode = {"_xla": " [XLA]", "_mixed": " [mixed_float16]", "_xla_mixed": " [XLA, mixed_float16]"}
    pairs, targets = [], {}
    for key in keys:
        pair, numerator, denominator, _ = ROWS[key]
        name = f"{label}: {pair}{mode.get(mode_suffix(args), '')}"
        pairs.append((name, sides[numerator], sides[denominator]))
        if target_of(key, model_name):
            targets[name] = target_of(key, model_name)
    results = interleaved_step_ratios(pairs, rounds)
    for stats in results.values():
        stats["steps"] = steps  # per round, on this model
    return results, targets


def markdown(results, targets):
    """One model's rows as a markdown table."""
    lines = [
        "| pair | target | median | min | max | best | p25 | step ms (ours / Keras) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in results.items():
        ms = " / ".join(f"{t:.2f}" for t in s["step_ms"])
        lines.append(
            f"| {name} | {targets.get(name, '')} | {s['median']:.3f} | {s['min']:.3f} | "
            f"{s['max']:.3f} | {s['best']:.3f} | {s['step_p25']:.3f} | {ms} |"
        )
    return "\n".join(lines) + "\n\n"


def append(path, text):
    if path:
        with open(path, "a") as f:
            f.write(text)


def gpu_names():
    names = [
        tf.config.experimental.get_device_details(g).get("device_name", "GPU")
        for g in tf.config.list_physical_devices("GPU")
    ]
    return f" ({', '.join(names)})" if names else ""


def options(parser):
    parser.add_argument("--rows", default=None, help=f"comma-separated, of {list(ROWS)}")
    parser.add_argument("--xla", action="store_true", help="jit_compile=True on both sides")
    parser.add_argument("--mixed", action="store_true", help="mixed_float16 on both sides")
    parser.add_argument("--cpu", action="store_true", help="on the CPU; refuses --mixed")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    parser.add_argument(
        "--build-order",
        choices=("alternate", "listed", "reversed"),
        default="alternate",
        help="build the sides in the rows' order, its reverse, or (default) the rows' "
        "order in odd processes of run_all and the reverse in even ones",
    )


def main(argv=None):
    args, rounds, steps, names = command_line(
        __doc__,
        (4, STEPS),
        (12, STEPS),
        list(MODELS),
        quick_models=list(QUICK),
        argv=argv,
        extra=options,
    )
    if args.mixed and args.cpu:
        raise ValueError(
            "`--mixed` is a GPU-only mode (mixed_float16 on a CPU measures nothing a user "
            "would run). Received: --mixed --cpu. Fix: drop one of them."
        )
    mode = {"_xla": ", XLA", "_mixed": ", mixed_float16", "_xla_mixed": ", XLA, mixed_float16"}
    title = (
        f"Issue 28's targets, step-time ratios ({rounds} rounds of {steps} steps "
        f"x each model's scale{mode.get(mode_suffix(args), '')}, sides built in "
        f"{build_order(args)} order)"
    )
    # Model by model: a run cut short (gpu_check's time limit) keeps its tables.
    append(args.markdown, f"### {title}\n\n{machine()}{gpu_names()}\n\n")
    results, targets = {}, {}
    device = tf.device("/CPU:0") if args.cpu else contextlib.nullcontext()
    try:
        if args.mixed:
            keras.mixed_precision.set_global_policy("mixed_float16")
        for name in names:
            with device:
                measured, wanted = measure(name, args, rounds, steps)
            append(args.markdown, markdown(measured, wanted))
            results.update(measured)
            targets.update(wanted)
            keras.backend.clear_session()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    entries = {"build_order": build_order(args)}
    report(title, results, targets, "targets" + mode_suffix(args), entries=entries)


if __name__ == "__main__":
    main()
