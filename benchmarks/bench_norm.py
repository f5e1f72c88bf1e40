"""The clip norm's overflow guard: what it costs, and what a branch-free one would.

    python benchmarks/bench_norm.py [--quick]

`clipping.scaled_norm` sums `tf.nn.l2_loss` per gradient in float32; only
when that sum overflows (a norm above ~1.8e19) does a `cond` recompute it
on the gradients times 2**-80. The alternative without a branch is to sum
the squares in float64 (no float32 square overflows there): one `Cast`
per gradient, a float64 copy of each. Timed here, interleaved in one
process (each round: 200 calls of a `tf.function` computing the norm of
fixed gradients), as ratios to the unguarded float32 `L2Loss` norm:
- guarded (ours, the `cond` not taken) / Keras' `global_clipnorm` norm
  (`Square` + `Sum`, which overflows above ~1.8e19)     target <= 1.05
- guarded / unguarded, float64 branch-free / unguarded,
  Keras' / unguarded                                    (information)
on the gradient shapes of the benchmark MLP (64 -> 3 x 256 -> 10) and of a
larger one (3 x 1024 x 1024).

Writes benchmarks/out/norm.json.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from harness import interleaved_ratios, report  # noqa: E402

from keras_fastgrad.backend.tensorflow.clipping import scaled_norm  # noqa: E402

SHAPES = {
    "mlp_64x256": [(64, 256), (256,), (256, 256), (256,), (256, 256), (256,), (256, 10), (10,)],
    "mlp_1024": [(1024, 1024), (1024,)] * 3,
}
CALLS = 200


def norms(shapes):
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=s).astype("float32")) for s in shapes]

    def guarded():
        unit, root = scaled_norm(grads)
        return unit * root

    def unguarded():
        return tf.sqrt(2.0 * tf.add_n([tf.nn.l2_loss(g) for g in grads]))

    def float64():
        halves = tf.add_n([tf.nn.l2_loss(tf.cast(g, tf.float64)) for g in grads])
        return tf.cast(tf.sqrt(2.0 * halves), tf.float32)

    def keras_norm():
        return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))

    fns = {}
    for name, fn in [
        ("guarded", guarded),
        ("unguarded", unguarded),
        ("float64", float64),
        ("keras", keras_norm),
    ]:
        compiled = tf.function(fn)
        expected = np.sqrt(
            sum(float(np.sum(np.square(g.numpy(), dtype=np.float64))) for g in grads)
        )
        assert abs(float(compiled()) - expected) <= 1e-5 * expected, name  # all four agree

        def repeat(compiled=compiled):
            for _ in range(CALLS):
                compiled()

        fns[name] = repeat
    return fns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else 15
    pairs = []
    for model, shapes in SHAPES.items():
        fns = norms(shapes)
        pairs.append((f"{model}: guarded / keras", fns["guarded"], fns["keras"]))
        for name in ("guarded", "float64", "keras"):
            pairs.append((f"{model}: {name} / unguarded", fns[name], fns["unguarded"]))
    results = interleaved_ratios(pairs, rounds)
    for stats in results.values():
        stats["kind"] = "time of the norm alone (not a step)"
    targets = {name: "<= 1.05" for name in results if name.endswith("guarded / keras")}
    report("The clip norm's overflow guard, interleaved (norm only)", results, targets, "norm")


if __name__ == "__main__":
    main()
