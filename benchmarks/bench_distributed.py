"""What accumulation costs under MirroredStrategy (2 logical CPU devices).

    python benchmarks/bench_distributed.py [--rounds N]

With `accumulation_steps=k` each replica adds its micro-batch gradient to
sync-on-read accumulators: the gradients are all-reduced once per update,
not once per micro-batch. Step-time ratios (`sides.step_fn`: each
side's compiled train function, batches distributed as `fit` does;
`harness.interleaved_step_ratios`), one process:
- FastGradModel(acc=4) / FastGradModel(acc=1): the all-reduce saved on 3 of
  4 micro-steps, minus the accumulation work;
- FastGradModel(acc=1) / keras.Model: the step's cost under a strategy
  (global finite check, global metrics, update in cross-replica context).
On logical CPU devices an all-reduce is a memory copy; on GPUs over a link
it costs more, so the saving measured here is a lower bound.

Runs in its own process under `run_all` (`OWN_PROCESS`): the two logical
devices must be configured before TensorFlow initialises. It has no quick
mode: its own TensorFlow start and tracing under the strategy took about
2 minutes of `run_all`'s 300 s quick budget.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
OWN_PROCESS = True

import keras  # noqa: E402
from bench_core import compiled, mlp  # noqa: E402
from harness import interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    rounds, steps = args.rounds, 16
    batch = 256
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    data = dataset_of(*synthetic((784,), 10, batch * steps), batch)
    fg = keras_fastgrad.FastGradModel
    with strategy.scope():
        acc1 = step_fn(compiled(mlp(fg), keras.optimizers.Adam()), data, steps)
        acc4 = step_fn(
            compiled(mlp(fg, accumulation_steps=4), keras.optimizers.Adam()), data, steps
        )
        plain = step_fn(compiled(mlp(keras.Model), keras.optimizers.Adam()), data, steps)
    pairs = [
        ("mirrored x2, mlp: FastGradModel(acc=4) / FastGradModel(acc=1)", acc4, acc1),
        ("mirrored x2, mlp: FastGradModel(acc=1) / keras.Model", acc1, plain),
    ]
    results = interleaved_step_ratios(pairs, rounds)
    report(
        f"MirroredStrategy (2 logical CPU devices), step-time ratios ({rounds} rounds x {steps} steps)",
        results,
        {},
        "distributed",
    )


if __name__ == "__main__":
    main()
