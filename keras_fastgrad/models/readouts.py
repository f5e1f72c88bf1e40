"""What `FastGradModel`'s step measured, read back: the telemetry keys the
step returns (`enable_telemetry`, `layer_norm_keys`) and its cumulative
counters (`telemetry_counters`). The model's methods of the same names
delegate here; all of it reads `model.fastgrad_step_state`."""

import numpy as np

from keras_fastgrad.step.telemetry import (
    AGC_CLIPPED_FRACTION,
    LOG_KEYS,
    is_optional_key,
    layer_key,
)

COUNTERS = ("updates", "clipped_updates", "nonfinite_count")


def layer_norm_keys(model):
    """The `grad_norm/<layer>` keys `model`'s layers would log."""
    return list(dict.fromkeys(layer_key(v.path) for v in model.trainable_variables))


def enable_telemetry(model, keys):
    """Adds `keys` to the step's logs; the train function is made again
    (retraced) on the next `fit` when the set of keys grows. See
    `FastGradModel.enable_telemetry`."""
    keys = set(keys)
    unknown = {k for k in keys if k not in LOG_KEYS and not is_optional_key(k)}
    if unknown:
        raise ValueError(
            f"`keys` must be names from {list(LOG_KEYS)}, "
            "`update_ratio`, `agc_clipped_fraction` or `grad_norm/<layer>` (multi-task models: "
            "`task_grad_norm/<task>`, `task_cosine/<a>/<b>`, "
            f"`task_conflicts`). Received unknown names: {sorted(unknown)}"
        )
    if AGC_CLIPPED_FRACTION in keys and model.clip_adaptive is None:
        raise ValueError(
            f"`keys` holds `{AGC_CLIPPED_FRACTION}`, which needs adaptive "
            "gradient clipping, but the model has clip_adaptive=None. "
            f"Received: keys={sorted(keys)}. Fix: build the model with "
            f"`clip_adaptive=...`, or leave `{AGC_CLIPPED_FRACTION}` out."
        )
    state = model.fastgrad_step_state
    if not keys <= state.log_keys:
        state.log_keys |= keys
        model.train_function = None


def telemetry_counters(model):
    """`{name: float}` of the step's `COUNTERS` now (zeros before the
    step's state exists). See `FastGradModel.telemetry_counters`."""
    telemetry = model.fastgrad_step_state.telemetry
    if telemetry is None:
        return dict.fromkeys(COUNTERS, 0.0)
    return {name: host_value(getattr(telemetry, name)) for name in COUNTERS}


def host_value(variable):
    """A scalar variable's value now, as a Python float: TensorFlow's
    `.numpy()` (a distributed variable's too), NumPy of the JAX array
    (`.numpy()` of a Keras variable warns on JAX with NumPy 2)."""
    value = variable.value
    return float(value.numpy() if hasattr(value, "numpy") else np.asarray(value))
