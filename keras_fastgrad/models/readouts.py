"""What `FastGradModel`'s step measured, read back (`StepReadouts`, one of
its bases): what the traced step saw (`tape_variable_count`,
`train_step_trace_count`, `variables_without_gradient`), the telemetry keys
it returns (`enable_telemetry`, `layer_norm_keys`) and its cumulative
counters (`telemetry_counters`). All of it reads `model.fastgrad_step_state`
(or, where the backends differ, asks the shell: `backend.shell()`)."""

import numpy as np

from keras_fastgrad import backend as _backend
from keras_fastgrad.step.telemetry import (
    AGC_CLIPPED_FRACTION,
    LOG_KEYS,
    is_optional_key,
    layer_key,
)

COUNTERS = ("updates", "clipped_updates", "nonfinite_count")


class StepReadouts:
    """`FastGradModel`'s read-outs of what its step measured (a base class
    of it, as Keras' `Model` inherits its `Trainer`)."""

    @property
    def tape_variable_count(self):
        """Number of variables the tape watched in the traced train step
        (`None` before the first trace). On JAX, which has no tape: the
        number of trainable variables `jax.value_and_grad` differentiates
        (all of them), once the train function is made."""
        return _backend.shell().tape_variable_count(self)

    @property
    def train_step_trace_count(self):
        """How many times `train_step` was traced (retracing shows here)."""
        return self.fastgrad_step_state.trace_count

    @property
    def variables_without_gradient(self):
        """Paths of trainable variables that got no gradient in the traced
        step (unused, or cut off by `stop_gradient`); `None` before the
        first trace. On JAX (where such a variable gets zeros, not `None`)
        they are read from the traced program only while the
        `tape_variables` key is requested (TapeVariableCounter,
        `telemetry=True`); `None` otherwise."""
        return self.fastgrad_step_state.no_gradient

    def layer_norm_keys(self):
        """The `grad_norm/<layer>` keys this model's layers would log."""
        return list(dict.fromkeys(layer_key(v.path) for v in self.trainable_variables))

    def enable_telemetry(self, keys=LOG_KEYS):
        """Adds telemetry keys to the step's logs (used by the callbacks).

        Args:
            keys: Iterable of names from `keras_fastgrad.LOG_KEYS`, or the
                optional keys (`grad_norm/<layer>`, `update_ratio`,
                `agc_clipped_fraction`, the multi-task keys).

        Raises:
            ValueError: for a name that is not a telemetry key, or
                `agc_clipped_fraction` on a model without `clip_adaptive`.

        The train function is rebuilt (retraced) on the next `fit` when the
        set of keys grows.
        """
        keys = set(keys)
        _backend.check_telemetry_keys(keys)
        unknown = {k for k in keys if k not in LOG_KEYS and not is_optional_key(k)}
        if unknown:
            raise ValueError(
                f"`keys` must be names from {list(LOG_KEYS)}, "
                "`update_ratio`, `agc_clipped_fraction` or `grad_norm/<layer>` (multi-task "
                "models: `task_grad_norm/<task>`, `task_cosine/<a>/<b>`, "
                f"`task_conflicts`). Received unknown names: {sorted(unknown)}"
            )
        if AGC_CLIPPED_FRACTION in keys and self.clip_adaptive is None:
            raise ValueError(
                f"`keys` holds `{AGC_CLIPPED_FRACTION}`, which needs adaptive "
                "gradient clipping, but the model has clip_adaptive=None. "
                f"Received: keys={sorted(keys)}. Fix: build the model with "
                f"`clip_adaptive=...`, or leave `{AGC_CLIPPED_FRACTION}` out."
            )
        state = self.fastgrad_step_state
        if not keys <= state.log_keys:
            state.log_keys |= keys
            self.train_function = None

    def telemetry_counters(self):
        """The step's cumulative counters now, as Python floats.

        Returns:
            Dict with `updates`, `clipped_updates` and `nonfinite_count`
            (over the model's life; saved with the model). Zeros before the
            step's state exists. Reads three scalars from the device.

        Example:

        >>> inputs = keras.Input((2,))
        >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.telemetry_counters()
        {'updates': 0.0, 'clipped_updates': 0.0, 'nonfinite_count': 0.0}
        """
        telemetry = self.fastgrad_step_state.telemetry
        if telemetry is None:
            return dict.fromkeys(COUNTERS, 0.0)
        return {name: host_value(getattr(telemetry, name)) for name in COUNTERS}


def host_value(variable):
    """A scalar variable's value now, as a Python float: TensorFlow's
    `.numpy()` (a distributed variable's too), NumPy of the JAX array
    (`.numpy()` of a Keras variable warns on JAX with NumPy 2)."""
    value = variable.value
    return float(value.numpy() if hasattr(value, "numpy") else np.asarray(value))
