"""The step's telemetry on Keras' JAX backend: the counters' and the
divergence streak's rules (`keras_fastgrad.step.telemetry`,
`keras_fastgrad.step.divergence`) applied to their values in Keras' state
tuple (`jax_state.Slots`, `jax_state.StepValues`), inside the jitted
step, where a traced branch
cannot assign: each change is selected (`where`) by the boolean scalar
that decided it.

What is JAX's own here: where a dropped micro-batch went bad is worked
out from the gradient arrays (while `nonfinite_first_index` or
`nonfinite_num_variables` is requested); `input_shape_changes` compares
the static shapes of the traced micro-batch; `tape_variables` is, with no
tape, the number of trainable variables the gradient
(`jax.value_and_grad`) is taken for, and while it is requested the trace
also finds the variables the loss does not reach (`record_trace_facts`:
JAX gives them a zero gradient where TensorFlow's tape gives `None`).

The optional keys (`keras_fastgrad.maths.telemetry`): `grad_norm/<layer>`
and `agc_clipped_fraction` of the update's gradient (after adaptive
clipping, before `clip_norm`) where its branch runs, `update_ratio` of an
applied update only, as on TensorFlow; their variables ride in the state
tuple with the step's others (not saved). The noise scale's keys come from
`jax_noise_scale`, the multi-task keys from the micro-batch's Gram matrix
(`keras_fastgrad.backend.jax.multitask`).
"""

import math

from keras import ops

from keras_fastgrad.backend.jax import noise_scale as jax_noise_scale
from keras_fastgrad.maths import finite
from keras_fastgrad.maths import telemetry as maths
from keras_fastgrad.step import divergence
from keras_fastgrad.step import telemetry as core
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.state import TraceFacts
from keras_fastgrad.step.telemetry import (
    AGC_CLIPPED_FRACTION,
    LOG_KEYS,
    UPDATE_RATIO,
)

COUNT_KEYS = core.COUNT_KEYS  # (`jax_agc.counted` reads it here)


def _change(new, change, where=True):
    """`core.apply` of a rule's `change` to `new`'s counters (`new`: the
    step's `jax_state.StepValues`)."""
    new.counters = core.apply(new.counters, change, where)


def requested(model):
    """The fixed keys the step returns (a set; the other optional keys are
    refused before the step is traced, the noise scale's are
    `jax_noise_scale`'s)."""
    return model.fastgrad_step_state.log_keys & set(LOG_KEYS)


def _location(model, grads):
    """`(first, num)`: the index of the first non-finite gradient (-1 when
    only the loss, or a clip factor, was) and how many were; `(None,
    None)` unless a key asks."""
    if not core.locates_nonfinite(requested(model)):
        return None, None
    if grads:  # (TensorFlow's `summarize` of its marks: a sum that overflows counts)
        return finite.summarize(finite.marks(grads), with_loss=False)
    return ops.zeros((), "float32"), -1.0


def record_drop(model, new, grads, dropped, failed):
    """A micro-batch dropped where `dropped` (boolean scalar): counted, with
    where it went bad while a key asks, and towards the divergence streak
    where `failed` (boolean scalar; `False`: never)."""
    _change(new, core.dropped(*_location(model, grads)), dropped)
    new.streak = divergence.streak_after(new.streak, failed=failed)


def record_ungated(model, new, grads, finite):
    """`skip_nonfinite=False` without loss scaling: a non-finite
    micro-batch is applied, and counted (with its location) only while a
    `nonfinite_*` key is requested, as on TensorFlow."""
    if core.counts_nonfinite(False, requested(model)):
        record_drop(model, new, grads, ~finite, failed=False)


def record_update(new, applied, norm, was_clipped):
    """An update applied where `applied` (boolean scalar): counted, its
    norm (`None`: not measured) and clipping recorded, the streak reset."""
    _change(new, core.updated(norm, was_clipped), applied)
    new.streak = divergence.streak_after(new.streak, failed=False, applied=applied)


def record_dropped_update(new, dropped):
    """A finite micro-batch (or window) whose update overflowed, dropped
    where `dropped` (boolean scalar): counted, and a failure."""
    _change(new, core.dropped_update(), dropped)
    new.streak = divergence.streak_after(new.streak, failed=dropped)


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
    count, static under `jit`) differs from the previous one's; only while
    the key is asked."""
    if "input_shape_changes" not in requested(model):
        return
    first = first_input(x)
    rows, size = float(first.shape[0]), float(math.prod(first.shape))
    counters = new.counters
    _change(new, core.input_shape(counters.last_input_batch, counters.last_input_size, rows, size))


def optional_variables(telemetry):
    """`telemetry.optional_variables()` (a built `StepTelemetry`)."""
    return telemetry.optional_variables()


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
    """Writes `measure`'s values into `new.measured` (`core.measures_after`)."""
    new.measured.update(core.measures_after(new.measured, measures, entered, applied))


def logs(model, slots, new, ov, num_trainable):
    """The requested keys' values (float32 scalars,
    `keras_fastgrad.step.telemetry.logs`), then the noise scale's
    (`jax_noise_scale`)."""
    keys = model.fastgrad_step_state.log_keys
    scale = ov[slots.scale.scale] if slots.scaler is not None else 1.0
    measured = [(k, new.measured[k]) for k in measured_keys(model)]
    out = core.logs(new.counters, scale, num_trainable, keys, measured)
    out.update(jax_noise_scale.logs(model, new, keys))
    return out
