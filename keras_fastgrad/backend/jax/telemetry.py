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
  constant, as the tape's watched variables are on TensorFlow. While it is
  requested, the trace also finds the variables the loss does not reach
  (`record_trace_facts`: JAX gives them a zero gradient where TensorFlow's
  tape gives `None`), for `model.variables_without_gradient` and
  `TapeVariableCounter`'s warning.
- `input_shape_changes`: micro-batches whose first input's shape differed
  from the previous one's (counted while the key is requested).

The optional keys, with TensorFlow's definitions and update rule
(`keras_fastgrad.step.telemetry`; the maths: `keras_fastgrad.maths.telemetry`):

- `grad_norm/<layer>`: each layer's part of the update's gradient (after
  adaptive clipping, before `clip_norm`), and `agc_clipped_fraction`: the
  fraction of units AGC clipped in it; both taken where the update's
  branch runs (a finite micro-batch, any micro-batch with
  `skip_nonfinite=False`, a complete window), as on TensorFlow;
- `update_ratio`: `||w_after - w_before|| / ||w_before||` of an applied
  update only.

Their variables are `StepTelemetry`'s (measurements, not saved: the files
are TensorFlow's); on JAX they ride in the state tuple with the step's
others (`optional_variables`, `jax_state`). The noise scale's
`gns_simple`, `gns_grad_sq`, `gns_trace` (with accumulation;
`telemetry=True` adds them there, as on TensorFlow) come from
`jax_noise_scale`. The multi-task keys (`task_grad_norm/<task>`,
`task_cosine/<a>/<b>`, `task_conflicts`) come from the micro-batch's Gram
matrix (`keras_fastgrad.backend.jax.multitask`).
"""

import math

from keras import ops

from keras_fastgrad.backend.jax import noise_scale as jax_noise_scale
from keras_fastgrad.maths import finite
from keras_fastgrad.maths import telemetry as maths
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.state import TraceFacts
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION, LOG_KEYS, UPDATE_RATIO

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
    if grads:  # (TensorFlow's `summarize` of its marks: a sum that overflows counts)
        first, num = finite.summarize(finite.marks(grads), with_loss=False)
        first, num = ops.cast(first, "float32"), ops.cast(num, "float32")
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


def record_trace_facts(model, state, x, y, sample_weight):
    """The traced step's facts (`StepState.facts`, as TensorFlow's tape
    records them): how many variables the gradient is taken for and which
    of them the loss does not reach (read from the program of Keras'
    `compute_loss_and_updates` over the trainable values,
    `jax_reaching.reaching_inputs`: one more trace of the forward pass).
    Only while `tape_variables` is requested (`TapeVariableCounter`,
    `telemetry=True`); a trace that does not look leaves no facts (`None`).
    Under `run_eagerly=True` (no trace) the first step looks, once."""
    import jax  # here: this module is imported on TensorFlow too, where JAX may be absent

    from keras_fastgrad.backend.jax.reaching import reaching_inputs

    tv, ntv, ov, mv = state
    traced = any(isinstance(v, jax.core.Tracer) for v in tv[:1])
    step_state = model.fastgrad_step_state
    if "tape_variables" not in requested(model):
        if traced:
            step_state.facts = None
        return
    if not traced and step_state.facts is not None:
        return

    def loss_of(trainable):
        loss, _ = model.compute_loss_and_updates(
            trainable, ntv, mv, x, y, sample_weight, training=True, optimizer_variables=ov
        )
        return loss

    reached = reaching_inputs(jax.make_jaxpr(loss_of)(list(tv)), 1)[0]
    grad_is_none = [i not in reached for i in range(len(tv))]
    step_state.facts = TraceFacts(
        tape_variables=len(tv),
        no_gradient=[v.path for v, none in zip(model.trainable_variables, grad_is_none) if none],
        grad_is_none=grad_is_none,
    )


def record_input_shape(model, new, x):
    """Counts a micro-batch whose first input's shape (rows or element
    count) differs from the previous one's; only while the key is asked."""
    if "input_shape_changes" not in requested(model):
        return
    first = first_input(x)
    rows, size = float(first.shape[0]), float(math.prod(first.shape))
    changed = (new["last_batch"] >= 0.0) & (
        (new["last_batch"] != rows) | (new["last_size"] != size)
    )
    new["shape_changes"] += ops.cast(changed, "float32")
    new["last_batch"] = ops.full_like(new["last_batch"], rows)
    new["last_size"] = ops.full_like(new["last_size"], size)


def optional_variables(telemetry):
    """`[(key, variable)]` of the optional keys `telemetry` (a built
    `StepTelemetry`) has variables for, in its logs' order."""
    pairs = list(telemetry.layer_norms.items())
    for key in (UPDATE_RATIO, AGC_CLIPPED_FRACTION):
        variable = getattr(telemetry, key)
        if variable is not None:
            pairs.append((key, variable))
    return pairs


def measured_keys(model):
    """The optional keys the step measures (`agc_clipped_fraction` only
    with `clip_adaptive`)."""
    keys = [k for k, _ in optional_variables(model.fastgrad_step_state.telemetry)]
    if model.fastgrad_step_state.options.clip_adaptive is None:
        keys = [k for k in keys if k != AGC_CLIPPED_FRACTION]
    return keys


def measure(model, grads, before, after, counted):
    """`{key: float32 scalar}`: the optional keys' values for one update
    (`{}` when none is requested).

    Args:
        model: The `FastGradModel`.
        grads: The update's gradient after adaptive clipping, before
            `clip_norm` (in `model.trainable_variables`' order).
        before: The trainable values before the update.
        after: The trainable values after it.
        counted: The dict `jax_agc.clip` filled (AGC's clipped fraction).
    """
    keys = measured_keys(model)
    layers = [k for k in keys if k not in (UPDATE_RATIO, AGC_CLIPPED_FRACTION)]
    out = {}
    if layers:
        layer_of = model.fastgrad_step_state.telemetry.layer_of_variable
        out.update(maths.layer_norms(grads, layer_of, layers))
    if UPDATE_RATIO in keys:
        out[UPDATE_RATIO] = maths.update_ratio(before, after)
    if AGC_CLIPPED_FRACTION in keys:
        out[AGC_CLIPPED_FRACTION] = counted[AGC_CLIPPED_FRACTION]
    return out


def unmeasured(model):
    """`measure`'s structure, zeros (the branch without an update)."""
    return {k: ops.zeros((), "float32") for k in measured_keys(model)}


def record_measures(new, measures, entered, applied):
    """Writes `measure`'s values into `new`: `update_ratio` where the
    update was `applied`, the gradient's keys where its branch was
    `entered` (boolean scalars, or `True`), as on TensorFlow."""
    for key, value in measures.items():
        where = applied if key == UPDATE_RATIO else entered
        new[key] = ops.where(where, value, new[key])


def logs(model, slots, new, ov, num_trainable):
    """The requested keys' values (float32 scalars), in `LOG_KEYS` order,
    then the optional keys' and the noise scale's (`jax_noise_scale`)."""
    gns = jax_noise_scale.logs(model, new, model.fastgrad_step_state.log_keys)
    gns = {**{k: ops.cast(new[k], "float32") for k in measured_keys(model)}, **gns}
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
