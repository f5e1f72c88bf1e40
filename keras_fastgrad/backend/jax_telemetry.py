"""The fixed telemetry log keys (`keras_fastgrad.step.telemetry.LOG_KEYS`)
on Keras' JAX backend, worked out inside the jitted step from the state's
values (`jax_step`), with the names and meanings they have on TensorFlow.

- `grad_norm`, `clipped_updates`, `updates`, `nonfinite_count`: the step's
  counters (`jax_units.record_update`); `grad_norm` is measured (before
  clipping) while the key is requested, or with `clip_norm`.
- `nonfinite_first_index`, `nonfinite_num_variables`: where the latest
  dropped micro-batch went bad, worked out while one of them is requested.
- `loss_scale`: the current loss scale (1 without loss scaling).
- `tape_variables`: on JAX there is no tape: the number of trainable
  variables the gradient (`jax.value_and_grad`) is taken for, a trace-time
  constant, as the tape's watched variables are on TensorFlow.
- `input_shape_changes`: micro-batches whose first input's shape differed
  from the previous one's (counted while the key is requested).

The noise scale's `gns_simple`, `gns_grad_sq`, `gns_trace` (with
accumulation; `telemetry=True` adds them there, as on TensorFlow) come from
`jax_noise_scale`. The other optional keys (`grad_norm/<layer>`,
`update_ratio`, `agc_clipped_fraction`, the multi-task keys) are refused by
name (`keras_fastgrad.backend.check_telemetry_keys`).
"""

import math

import keras
from keras import ops

from keras_fastgrad.backend import jax_noise_scale
from keras_fastgrad.step.telemetry import LOG_KEYS

LOCATION_KEYS = ("nonfinite_first_index", "nonfinite_num_variables")
COUNT_KEYS = ("nonfinite_count",) + LOCATION_KEYS


def requested(model):
    """The fixed keys the step returns (a set; the other optional keys are
    refused before the step is traced, the noise scale's are
    `jax_noise_scale`'s)."""
    return model.fastgrad_step_state.log_keys & set(LOG_KEYS)


def record_location(model, new, grads, dropped):
    """Where a dropped micro-batch went bad (`dropped`: boolean scalar):
    the index of its first non-finite gradient (-1 when only the loss, or a
    clip factor, was) and how many were; only while a key asks."""
    if not requested(model) & set(LOCATION_KEYS):
        return
    if grads:
        bad = ops.stack([~ops.all(ops.isfinite(g)) for g in grads])
        num = ops.sum(ops.cast(bad, "float32"))
        first = ops.where(num > 0, ops.cast(ops.argmax(bad), "float32"), -1.0)
    else:
        num, first = ops.zeros((), "float32"), ops.convert_to_tensor(-1.0)
    new["first_index"] = ops.where(dropped, first, new["first_index"])
    new["num_bad"] = ops.where(dropped, num, new["num_bad"])


def record_ungated(model, new, grads, finite):
    """`skip_nonfinite=False` without loss scaling: a non-finite
    micro-batch is applied, and counted (with its location) only while a
    `nonfinite_*` key is requested, as on TensorFlow."""
    if requested(model) & set(COUNT_KEYS):
        new["nonfinite_count"] += ops.cast(~finite, "float32")
        record_location(model, new, grads, ~finite)


def record_input_shape(model, new, x):
    """Counts a micro-batch whose first input's shape (rows or element
    count) differs from the previous one's; only while the key is asked."""
    if "input_shape_changes" not in requested(model):
        return
    first = keras.tree.flatten(x)[0]
    rows, size = float(first.shape[0]), float(math.prod(first.shape))
    changed = (new["last_batch"] >= 0.0) & (
        (new["last_batch"] != rows) | (new["last_size"] != size)
    )
    new["shape_changes"] += ops.cast(changed, "float32")
    new["last_batch"] = ops.full_like(new["last_batch"], rows)
    new["last_size"] = ops.full_like(new["last_size"], size)


def logs(model, slots, new, ov, num_trainable):
    """The requested keys' values (float32 scalars), in `LOG_KEYS` order,
    then the noise scale's (`jax_noise_scale`)."""
    gns = jax_noise_scale.logs(model, new, model.fastgrad_step_state.log_keys)
    keys = requested(model)
    if not keys:
        return gns
    scale = ov[slots.ov["scale"]] if slots.scaler is not None else 1.0
    values = {
        "grad_norm": new["grad_norm"],
        "clipped_updates": new["clipped_updates"],
        "updates": new["updates"],
        "nonfinite_count": new["nonfinite_count"],
        "nonfinite_first_index": new["first_index"],
        "nonfinite_num_variables": new["num_bad"],
        "loss_scale": scale,
        "tape_variables": float(num_trainable),
        "input_shape_changes": new["shape_changes"],
    }
    return {**{k: ops.cast(values[k], "float32") for k in LOG_KEYS if k in keys}, **gns}
