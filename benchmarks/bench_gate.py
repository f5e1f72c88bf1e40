"""What gating the update on the whole gradient costs keras.Model itself.

    python benchmarks/bench_gate.py [--quick] [--rounds N]

A safe step may apply nothing before it knows that every gradient is
finite: its update waits for the last gradient of the backward pass.
`keras.Model` applies each variable's update as soon as its gradient
exists, so on a CPU the optimizer's work on the last layers overlaps the
backward pass of the first ones. This measures that overlap, without any
keras_fastgrad code: the same `keras.Model` subclass with three
`train_step`s (the tape, `compute_loss` and `optimizer.apply` as Keras'
own step has them):
- `plain`: `optimizer.apply(grads)`, as Keras does;
- `loss`: the update in a `tf.cond` on the loss being finite (a predicate
  known before the backward pass);
- `grads`: the update in a `tf.cond` on every gradient's sum being finite
  (what a non-finite check needs; Keras' `LossScaleOptimizer` gates on
  the gradients the same way).
Ratios `loss / plain` and `grads / plain` (`sides.step_fn`: the compiled
`train_function` timed step by step, interleaved; median, min, max, best
round and `p25`), on the two MLPs of `bench_targets` (64 -> 3 x 256 -> 10 and
256 -> 3 x 1024 -> 10, batch 64, Adam). No target: it explains the
`default / ungated keras.Model` rows of `bench_targets` on update-heavy
models.

Writes benchmarks/out/gate.json.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402


class Gated(keras.Model):
    """`keras.Model` whose update is gated as `gate` says."""

    def __init__(self, *args, gate="plain", **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        if self.gate == "plain":
            self.optimizer.apply(grads, variables)
        else:
            if self.gate == "loss":
                finite = tf.math.is_finite(loss)
            else:
                sums = tf.stack([tf.reduce_sum(g) for g in grads])
                finite = tf.reduce_all(tf.math.is_finite(sums))

            def apply():
                self.optimizer.apply(grads, variables)
                return tf.constant(0)

            tf.cond(finite, apply, lambda: tf.constant(0))
        return {"loss": loss}


def mlp(features, width, gate):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = Gated(inputs, keras.layers.Dense(10)(h), gate=gate)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


MODELS = {"mlp_64x256_b64": (64, 256), "mlp_256x1024_b64": (256, 1024)}


def main(argv=None):
    args, rounds, steps, _ = command_line(__doc__, (4, 16), (16, 48), argv=argv)
    pairs = []
    # Quick mode: the larger MLP, where the gate shows.
    names = ["mlp_256x1024_b64"] if args.quick else list(MODELS)
    for name in names:
        features, width = MODELS[name]
        data = dataset_of(*synthetic((features,), 10, 64 * 16), 64)
        side = {gate: step_fn(mlp(features, width, gate), data, steps) for gate in GATES}
        pairs += [
            (f"{name}: update gated on the loss / not gated", side["loss"], side["plain"]),
            (f"{name}: update gated on every gradient / not gated", side["grads"], side["plain"]),
        ]
    report(
        f"keras.Model, the cost of gating the update ({rounds} rounds x {steps} steps)",
        interleaved_step_ratios(pairs, rounds),
        {},
        "gate",
    )


GATES = ("plain", "loss", "grads")

if __name__ == "__main__":
    main()
