"""The telemetry keys leave the compiled step as one tensor (TensorFlow).

Keras' TensorFlow train function hands the step's outputs back through a
`tf.experimental.Optional` that it unpacks on the host at every call
(`keras/src/backend/tensorflow/trainer.py`: `opt_outputs.get_value()`),
and that unpacking costs a fixed time per output (`docs/benchmarks.md`,
`benchmarks/bench_targets.py` row `logs_cost`). The telemetry keys are
many (nine with `telemetry=True`, five for the three usual callbacks), so
the train function the model makes carries them stacked in one float32
vector under `PACKED_KEY`, and hands the logs back with the keys as they
were (`unpacking`), in the step's order: the logs `fit`, `train_on_batch`
and the callbacks see are unchanged, and so is what `train_step` returns
(a subclass that reads `grad_norm` from `super().train_step` still does):
only the function Keras traces around it packs.

    train_step -> [packing_step: stack the telemetry keys] -> Keras'
    Optional -> [unpacking: NumPy float32 scalars on the host (a GPU's
    vector: `tf.unstack`, nothing synchronised)]

JAX's trainer returns its logs as arrays, without that unpacking: not used
there.
"""

import numpy as np

from keras_fastgrad._tf_startup import tf

PACKED_KEY = "_fastgrad_telemetry"


def packing_step(step, state):
    """`step` (a bound `train_step`) returning the telemetry keys it
    logged (`state.telemetry_names`, recorded by the step as it traces)
    stacked in one float32 vector under `PACKED_KEY` (checked in
    `tests/models/test_log_packing.py`)."""

    def train_step(*args, **kwargs):
        logs = step(*args, **kwargs)
        if not isinstance(logs, dict):
            return logs
        names = tuple(k for k in state.telemetry_names if k in logs)
        if len(names) < 2:  # one key: one output either way
            return logs
        packed = {k: v for k, v in logs.items() if k not in names}
        # (axis -1: a multi-worker `[1]` log stacks to `[1, K]`, which
        # Keras' reduction over axis 0 keeps per key)
        packed[PACKED_KEY] = tf.stack([tf.cast(logs[k], tf.float32) for k in names], axis=-1)
        state.packed_names = names
        return packed

    return train_step


def unpacking(function, state):
    """Keras' train function (`function(iterator)`) handing back the
    packed telemetry keys one by one, in the order the step logged them.

    Raises:
        RuntimeError: when the vector's length is not the number of names
            the step recorded (never silently mislabelled).
    """

    def train_function(*args):
        logs = function(*args)
        if not isinstance(logs, dict) or PACKED_KEY not in logs:
            return logs
        logs = dict(logs)
        packed = logs.pop(PACKED_KEY)
        names = state.packed_names
        if "GPU" in packed.device or "TPU" in packed.device:
            values = tf.unstack(tf.reshape(packed, [-1]))  # asynchronous
        else:  # one host copy of K floats (the CPU's step has ended)
            values = list(np.reshape(packed.numpy(), [-1]))
        if len(values) != len(names):
            raise RuntimeError(
                f"The step's packed telemetry holds {len(values)} values for the "
                f"{len(names)} keys {list(names)} it recorded: the train function and "
                "the step state disagree. Fix: `model.make_train_function(force=True)` "
                "before the next `fit` (please report this)."
            )
        logs.update(zip(names, values))
        return logs

    return train_function
