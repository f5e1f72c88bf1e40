"""What the traced train step holds: op counts, FastGradModel / keras.Model.

    python benchmarks/bench_graph.py [--quick]

Timing ratios on a noisy 2-core machine spread by +-50% per round; the
traced graph does not. This counts the operations of `train_step` traced
with `tf.function` on one batch (cond branches and other nested functions
included), for `keras.Model` and FastGradModel configurations on the same
MLP (64 -> 3 x 256 -> 10, batch 64, Adam): a refactor that leaves these
counts unchanged adds no work to the step, and a change that adds ops shows
by how much, independent of the machine's load. Not a time: an op on a
4x4 matrix counts as much as a matmul. (Placeholders, the inputs of nested
functions, are counted apart: they cost no kernel.)

Ratios (exact, one "round"):
- default / keras.Model, accumulation 4 / keras.Model with
  `gradient_accumulation_steps=4`, clip_norm / keras.Model with
  `global_clipnorm`, telemetry / default, accumulation 4 with the
  gradient noise scale measured / accumulation 4, multitask PCGrad (T=2 heads) /
  keras.Model summed loss.

Targets (issue 21, "safety at no cost"): default <= keras.Model + 40 ops,
accumulation 4 <= Keras' accumulation 4 + 60, clip_norm <= Keras'
`global_clipnorm` + 60.

Writes benchmarks/out/graph.json.
"""

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from harness import report  # noqa: E402

import keras_fastgrad  # noqa: E402

BATCH = 64


def mlp(cls, heads=1, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(256, activation="relu")(h)
    if heads == 1:
        return cls(inputs, keras.layers.Dense(10)(h), **options)
    return cls(
        inputs, {f"t{i}": keras.layers.Dense(10, name=f"t{i}")(h) for i in range(heads)}, **options
    )


def with_noise_scale(model):
    """`model` measuring the gradient noise scale (`GradientNoiseScale`'s keys)."""
    model.enable_telemetry(keras_fastgrad.callbacks.GradientNoiseScale.telemetry_keys)
    return model


def traced_ops(model, heads=1, **compile_kwargs):
    """`(ops, placeholders)` of `train_step` traced on one batch, after one
    `fit` step built the model, the optimizer and the step's state."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(**compile_kwargs),
        loss=loss if heads == 1 else {f"t{i}": loss for i in range(heads)},
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 64)).astype("float32")
    label = rng.integers(0, 10, size=(BATCH,))
    y = label if heads == 1 else {f"t{i}": label for i in range(heads)}
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    y_spec = tf.TensorSpec([BATCH], tf.int64)
    spec = (
        tf.TensorSpec([BATCH, 64], tf.float32),
        y_spec if heads == 1 else {f"t{i}": y_spec for i in range(heads)},
    )
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    counts = collections.Counter()
    seen = set()

    def walk(g):
        for op in g.get_operations():
            counts[op.type] += 1
        for name, fn in getattr(g, "_functions", {}).items():
            if name not in seen:
                seen.add(name)
                walk(fn.graph)

    walk(graph)
    placeholders = counts.pop("Placeholder", 0)
    return sum(counts.values()), placeholders


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="(the same: nothing is timed)")
    parser.parse_args(argv)
    fg = keras_fastgrad.FastGradModel
    sides = {
        "keras": traced_ops(mlp(keras.Model)),
        "default": traced_ops(mlp(fg)),
        "keras_acc4": traced_ops(mlp(keras.Model), gradient_accumulation_steps=4),
        "acc4": traced_ops(mlp(fg, accumulation_steps=4)),
        "keras_clip": traced_ops(mlp(keras.Model), global_clipnorm=1.0),
        "clip": traced_ops(mlp(fg, clip_norm=1.0)),
        "telemetry": traced_ops(mlp(fg, telemetry=True)),
        "acc4_gns": traced_ops(with_noise_scale(mlp(fg, accumulation_steps=4))),
        "clip_adaptive": traced_ops(mlp(fg, clip_adaptive=0.01)),
        "keras_2heads": traced_ops(mlp(keras.Model, heads=2), heads=2),
        "pcgrad_2heads": traced_ops(mlp(fg, heads=2, multitask="pcgrad"), heads=2),
    }
    print("ops (placeholders) per traced train_step:")
    for name, (ops, placeholders) in sides.items():
        print(f"  {name:16s} {ops:5d} ({placeholders})")
    rows = [
        ("default / keras.Model", "default", "keras"),
        ("accumulation 4 / keras.Model gradient_accumulation_steps=4", "acc4", "keras_acc4"),
        ("clip_norm / keras.Model global_clipnorm", "clip", "keras_clip"),
        ("telemetry / default", "telemetry", "default"),
        ("accumulation 4 + noise scale / accumulation 4", "acc4_gns", "acc4"),
        ("clip_adaptive=0.01 / default", "clip_adaptive", "default"),
        ("multitask pcgrad (T=2) / keras.Model summed loss", "pcgrad_2heads", "keras_2heads"),
    ]
    results = {}
    for label, a, b in rows:
        ratio = sides[a][0] / sides[b][0]
        results[f"ops: {label}"] = {
            "median": ratio,
            "min": ratio,
            "max": ratio,
            "rounds": 1,
            "kind": "op count (not a time)",
            "counts": [sides[a][0], sides[b][0]],
        }
    # Issue 21: safety at (nearly) no cost, in ops over the Keras feature.
    budgets = {"default": ("keras", 40), "acc4": ("keras_acc4", 60), "clip": ("keras_clip", 60)}
    targets = {}
    print("targets (ops over the keras.Model equivalent):")
    for a, (b, budget) in budgets.items():
        extra = sides[a][0] - sides[b][0]
        verdict = "met" if extra <= budget else "NOT met"
        print(
            f"  {a:8s} {sides[a][0]:4d} = {b} {sides[b][0]} + {extra:3d} (<= +{budget}: {verdict})"
        )
        label = next(label for label, x, _ in rows if x == a)
        targets[f"ops: {label}"] = f"<= {(sides[b][0] + budget) / sides[b][0]:.3f} (+{budget} ops)"
    report("Ops in the traced train step (exact; not a time)", results, targets, "graph")


if __name__ == "__main__":
    main()
