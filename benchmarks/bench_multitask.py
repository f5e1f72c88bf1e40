"""Cost of multi-task merging (issue 4), ratios in one process, interleaved.

    python benchmarks/bench_multitask.py [--quick | --target | --space]
                                         [--rounds N] [--steps N]

Model: 784 -> 3 x 1024 Dense relu (shared trunk) -> T heads Dense(10),
sparse categorical cross-entropy per head, Adam, batch 256, synthetic data
from a fixed seed, T = 2 and 4. Step-time ratios: each side's compiled
train function timed step by step (`sides.step_fn`), interleaved round
by round, the order alternating (`harness.interleaved_step_ratios`: the
median judged, `p25` and `best` beside it):

- floor / keras.Model: a step that computes the T task gradients from one
  persistent tape (T backward passes) and sums them / `keras.Model`'s
  summed-loss step (one backward pass). Any per-task method pays this.
- PCGrad / floor: `FastGradModel(multitask="pcgrad")` / the floor.
  Target <= 1.05 at T=4 (the merge is nearly free).
- merge alone / sum alone: `TaskMerger("pcgrad").merge` (Gram matrix,
  weights, `w^T J`) / `tf.add_n` per variable, both in a `tf.function` on
  the same fixed T task gradients of this model (public API only; a call
  of each is a "step" here, not a train step). Printed with it: the
  merge's extra time as a share of the floor's step,
  `(median merge - median sum) / median floor step`; the rest of
  `PCGrad / floor - 1` is FastGradModel's step around the backward passes
  (finite check, `cond`, telemetry, ...).
- PCGrad / naive PCGrad: / a step of the tutorial kind: shared gradients
  flattened into one vector per task, pairwise projections in vector space
  (the same algorithm, O(T^2 P) vector work). Target <= 0.75.
- jacobian floor / floor: the T task gradients from `tape.jacobian` of the
  stacked task losses (pfor) instead of the tape loop.
- batched-cotangent floor / floor: the heads' gradients by the tape loop,
  the trunk's T gradients in one vectorised backward pass (pfor over the T
  cotangents of the trunk output).
- PCGrad / keras.Model: what a user pays over the summed loss.

Representation space (`--space`, issue 12; T = 2, 4, 8): the same model
and data, three sides per T: `keras.Model` (summed loss), PCGrad in
parameter space (T trunk backward passes) and PCGrad with
`multitask_space="features"` (T head backward passes, one trunk backward):

- features PCGrad / keras.Model: target <= 1.20 at T=4.
- parameters PCGrad / keras.Model, features / parameters PCGrad.

`--target`: only the rows of the T=4 target (floor, PCGrad, merge and sum
alone), 16 rounds of 24 steps. `--quick`: the same rows, 4 rounds of 8
steps. Writes benchmarks/out/multitask.json (`--space`:
multitask_space.json).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from harness import interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn  # noqa: E402

import keras_fastgrad  # noqa: E402
from keras_fastgrad.multitask import TaskMerger, task_losses  # noqa: E402

BATCH = 256


def mlp(cls, num_tasks, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(1024, activation="relu", name=f"trunk_{i}")(h)
    outputs = {f"t{t}": keras.layers.Dense(10, name=f"t{t}")(h) for t in range(num_tasks)}
    return cls(inputs, outputs, **options)


class _TaskStep(keras.Model):
    """A `keras.Model` whose step gets its gradient from `gradients`."""

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_variables
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            for v in variables:
                tape.watch(v.value)
            y_pred = self(x, training=True)
            tasks = task_losses(self, y, y_pred)
            self.stacked = tf.stack(tasks)  # recorded: `tape.jacobian` needs it
        grads = self.gradients(tape, tasks, variables)
        self.optimizer.apply(grads, variables)
        self._loss_tracker.update_state(tf.add_n(tasks))
        return self.compute_metrics(x, y, y_pred)

    @staticmethod
    def per_task(tape, tasks, variables):
        return [tape.gradient(t, [v.value for v in variables]) for t in tasks]


def _sum(columns):
    present = [g for g in columns if g is not None]
    return None if not present else tf.add_n(present)


class Floor(_TaskStep):
    """T backward passes from one persistent tape, summed."""

    def gradients(self, tape, tasks, variables):
        return [_sum(c) for c in zip(*self.per_task(tape, tasks, variables))]


class JacobianFloor(_TaskStep):
    """`tape.jacobian` of the stacked task losses (pfor), summed over tasks."""

    def gradients(self, tape, tasks, variables):
        jac = tape.jacobian(self.stacked, [v.value for v in variables])
        return [None if j is None else tf.reduce_sum(j, axis=0) for j in jac]


class BatchedCotangentFloor(_TaskStep):
    """Heads by the tape loop; the trunk's T gradients in one vectorised
    backward pass: T cotangents of the trunk output, pfor over them."""

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_variables
        trunk = [v for v in variables if v.path.startswith("trunk")]
        heads = [v for v in variables if not v.path.startswith("trunk")]
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            for v in variables:
                tape.watch(v.value)
            h = x
            for i in range(3):
                h = self.get_layer(f"trunk_{i}")(h)
            tape.watch(h)
            y_pred = {name: self.get_layer(name)(h) for name in self.output_names}
            tasks = task_losses(self, y, y_pred)
        head_and_h = [tape.gradient(t, [h] + [v.value for v in heads]) for t in tasks]
        cotangents = tf.stack([g[0] for g in head_and_h])  # [T, B, 1024]
        trunk_grads = tf.vectorized_map(
            lambda c: tape.gradient(h, [v.value for v in trunk], output_gradients=c),
            cotangents,
        )
        by_variable = {id(v): tf.reduce_sum(g, axis=0) for v, g in zip(trunk, trunk_grads)}
        for k, v in enumerate(heads):
            by_variable[id(v)] = _sum([g[1 + k] for g in head_and_h])
        grads = [by_variable[id(v)] for v in variables]
        self.optimizer.apply(grads, variables)
        self._loss_tracker.update_state(tf.add_n(tasks))
        return self.compute_metrics(x, y, y_pred)


class NaivePCGrad(_TaskStep):
    """PCGrad as tutorials write it: flatten the shared gradients into one
    vector per task, project pairwise in vector space (random order per
    task), sum; heads keep their own gradients."""

    def gradients(self, tape, tasks, variables):
        per_task = self.per_task(tape, tasks, variables)
        num_tasks = len(tasks)
        shared = [k for k in range(len(variables)) if all(g[k] is not None for g in per_task)]
        flat = [tf.concat([tf.reshape(g[k], [-1]) for k in shared], 0) for g in per_task]
        projected = []
        for i in range(num_tasks):
            g = flat[i]
            others = tf.random.shuffle(tf.constant([j for j in range(num_tasks) if j != i]))
            stacked = tf.stack(flat)
            for k in range(num_tasks - 1):
                g_j = tf.gather(stacked, others[k])
                dot = tf.reduce_sum(g * g_j)
                g = g - tf.where(dot < 0, dot / tf.reduce_sum(g_j * g_j), 0.0) * g_j
            projected.append(g)
        merged = tf.add_n(projected)
        grads = [_sum(c) for c in zip(*per_task)]
        sizes = [int(np.prod(variables[k].shape)) for k in shared]
        for k, part in zip(shared, tf.split(merged, sizes)):
            grads[k] = tf.reshape(part, variables[k].shape)
        return grads


def merge_fns(num_tasks, x, y, steps):
    """(merge, total): zero-argument functions that each time `steps`
    calls of `TaskMerger("pcgrad").merge` / a per-variable `tf.add_n` on
    the same fixed task gradients (the floor model's, on one batch)."""
    model = mlp(Floor, num_tasks)
    model.compile(
        loss={
            name: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            for name in model.output_names
        }
    )
    xb, yb = x[:BATCH], {k: v[:BATCH] for k, v in y.items()}
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        tasks = task_losses(model, yb, model(xb, training=True))
    per_task = [tape.gradient(t, variables) for t in tasks]
    merger = TaskMerger("pcgrad")

    @tf.function(autograph=False)
    def merge(grads):
        return merger.merge(grads)[0]

    @tf.function(autograph=False)
    def total(grads):
        return [_sum(c) for c in zip(*grads)]

    def timed(fn):
        def run():
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                fn(per_task)
                seconds.append(time.perf_counter() - start)
            return seconds

        run()  # trace
        return run

    return timed(merge), timed(total)


def timed_steps(model, data, steps):
    """`sides.step_fn` of `model`, compiled with one loss per head."""
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss={
            name: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            for name in model.output_names
        },
    )
    return step_fn(model, data, steps)


def task_data(num_tasks, steps):
    """`(x, y, dataset)`: `steps` batches of synthetic data, T labels."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, 784)).astype("float32")
    y = {f"t{t}": rng.integers(0, 10, BATCH * steps).astype("int32") for t in range(num_tasks)}
    return x, y, dataset_of(x, y, BATCH)


def spaces(rounds, steps, task_counts=(2, 4, 8)):
    """Features- vs parameter-space PCGrad vs keras.Model, interleaved."""
    results, targets = {}, {}
    for num_tasks in task_counts:
        _, _, data = task_data(num_tasks, 8)
        fast = keras_fastgrad.FastGradModel
        run = {
            "keras": timed_steps(mlp(keras.Model, num_tasks), data, steps),
            "parameters": timed_steps(mlp(fast, num_tasks, multitask="pcgrad"), data, steps),
            "features": timed_steps(
                mlp(fast, num_tasks, multitask="pcgrad", multitask_space="features"), data, steps
            ),
        }
        pairs = [
            ("features PCGrad / keras.Model summed loss", "features", "keras", "<= 1.20 at T=4"),
            ("parameters PCGrad / keras.Model summed loss", "parameters", "keras", ""),
            ("features PCGrad / parameters PCGrad", "features", "parameters", "< 1"),
        ]
        named = [(f"T={num_tasks}: {name}", run[a], run[b]) for name, a, b, _ in pairs]
        results.update(interleaved_step_ratios(named, rounds))
        targets.update({f"T={num_tasks}: {name}": t for name, _, _, t in pairs})
        keras.backend.clear_session()
    _report(rounds, steps, results, targets, "multitask_space")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--space", action="store_true", help="only the features- vs parameter-space rows"
    )
    parser.add_argument(
        "--target", action="store_true", help="only the PCGrad / floor target's rows, at T=4"
    )
    parser.add_argument("--rounds", type=int, help="override the round count")
    parser.add_argument("--steps", type=int, help="override the steps per round")
    args = parser.parse_args(argv)
    rounds, steps = (4, 8) if args.quick else (12, 16)
    if args.target:  # long epochs: fit's per-epoch overhead and noise shrink
        rounds, steps = 16, 24
    rounds, steps = args.rounds or rounds, args.steps or steps
    if args.space:
        return spaces(rounds, steps)
    # Quick and target modes measure the target case only (T=4).
    task_counts = (4,) if args.quick or args.target else (2, 4)
    results, targets, extra = {}, {}, {}
    for num_tasks in task_counts:
        x, y, data = task_data(num_tasks, 8)
        run = {
            "floor": timed_steps(mlp(Floor, num_tasks), data, steps),
            "pcgrad": timed_steps(
                mlp(keras_fastgrad.FastGradModel, num_tasks, multitask="pcgrad"), data, steps
            ),
        }
        if not (args.target or args.quick):
            run.update(
                {
                    name: timed_steps(mlp(cls, num_tasks), data, steps)
                    for name, cls in (
                        ("keras", keras.Model),
                        ("naive", NaivePCGrad),
                        ("jacobian", JacobianFloor),
                        ("batched", BatchedCotangentFloor),
                    )
                }
            )
        run["merge"], run["sum"] = merge_fns(num_tasks, x, y, steps)
        pairs = [
            ("floor / keras.Model summed loss", "floor", "keras", "about 2 at T=4 (issue)"),
            ("PCGrad / floor", "pcgrad", "floor", "<= 1.05 at T=4"),
            ("merge alone / sum alone (fixed gradients)", "merge", "sum", "lower is better"),
            ("PCGrad / naive PCGrad", "pcgrad", "naive", "<= 0.75"),
            ("jacobian floor / tape-loop floor", "jacobian", "floor", "< 1 to switch"),
            ("batched-cotangent floor / tape-loop floor", "batched", "floor", "< 1 to switch"),
            ("PCGrad / keras.Model summed loss", "pcgrad", "keras", "for the README"),
        ]
        pairs = [p for p in pairs if p[1] in run and p[2] in run]
        named = [(f"T={num_tasks}: {name}", run[a], run[b]) for name, a, b, _ in pairs]
        ratios = interleaved_step_ratios(named, rounds)
        merge_row = f"T={num_tasks}: merge alone / sum alone (fixed gradients)"
        ratios[merge_row]["kind"] = "the merge alone (not a train step)"
        results.update(ratios)
        targets.update({f"T={num_tasks}: {name}": t for name, _, _, t in pairs})
        merge_ms, sum_ms = ratios[merge_row]["step_ms"]
        floor_ms = ratios[f"T={num_tasks}: PCGrad / floor"]["step_ms"][1]
        extra[f"T={num_tasks}: merge's extra time / floor step"] = (merge_ms - sum_ms) / floor_ms
        keras.backend.clear_session()
    _report(rounds, steps, results, targets, extra=extra)


def _report(rounds, steps, results, targets, out_name="multitask", extra=None):
    report(
        f"Multi-task step-time ratios ({rounds} rounds x {steps} steps, batch {BATCH})",
        results,
        targets,
        out_name,
    )
    for name, value in (extra or {}).items():
        print(
            f"{name:58s} {value:7.3f}  (medians; PCGrad / floor - 1 - this "
            "= FastGradModel's step around the backward passes)"
        )
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"{out_name}.json")
    with open(path) as f:
        saved = json.load(f)
    saved.update(extra or {})
    with open(path, "w") as f:
        json.dump(saved, f, indent=2)


if __name__ == "__main__":
    main()
