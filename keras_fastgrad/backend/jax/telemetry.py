"""The step's telemetry on Keras' JAX backend: each event's change of the
counters and the divergence streak (`keras_fastgrad.step.telemetry`'s
`Change`) applied to their values in Keras' state tuple
(`jax_state.Slots`, `jax_state.StepValues`) by `core.apply_change`, inside the jitted step, where a
traced branch cannot assign: each change is selected (`where`) by the
boolean scalar that decided it.

What is JAX's own here: where a dropped micro-batch went bad is worked
out from the gradient arrays (while `nonfinite_first_index` or
`nonfinite_num_variables` is requested); `input_shape_changes` compares
the static shapes of the traced micro-batch. (`tape_variables` and the
variables the loss does not reach are read from the traced program:
`jax_reaching.record_trace_facts`.)

The optional keys (`keras_fastgrad.maths.telemetry`): `grad_norm/<layer>`
and `agc_clipped_fraction` of the update's gradient (after adaptive
clipping, before `clip_norm`) where its branch runs, `update_ratio` of an
applied update only, as on TensorFlow; their variables ride in the state
tuple with the step's others (not saved). The log dict is the core's
(`core.logs`, the noise scale's keys included), the multi-task keys come
from the micro-batch's Gram matrix
(`keras_fastgrad.backend.jax.multitask`).
"""

import math

from keras import ops

from keras_fastgrad.maths import finite
from keras_fastgrad.step import micro_batch
from keras_fastgrad.step import telemetry as core
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION, LOG_KEYS


def record(new, change, where=True):
    """`core.apply_change` of `change` (a `core.Change`) to `new`'s counters
    and streak (`new`: the step's `jax_state.StepValues`)."""
    new.counters, new.streak = core.apply_change(new.counters, new.streak, change, where)


def requested(model):
    """The fixed keys the step returns (a set; the other optional keys are
    refused before the step is traced, the noise scale's are
    `jax_noise_scale`'s)."""
    return model.fastgrad_step_state.log_keys & set(LOG_KEYS)


def record_drop(model, new, grads, dropped, failed, gated=True):
    """`micro_batch.dropped`'s change of a micro-batch dropped where
    `dropped` (boolean scalar), a failure where `failed` holds; its
    location read from the gradients' marks (a gradient whose sum
    overflows counts, as on TensorFlow)."""
    marks = lambda: finite.marks(grads) if grads else None  # noqa: E731
    change = micro_batch.dropped(requested(model), marks, failed, gated, with_loss=False)
    record(new, change, dropped)


class Drops:
    """`micro_batch.before_update`'s shell: the micro-batch's drop (or,
    ungated, its non-finite count) recorded by mask (`record_drop`)."""

    def __init__(self, model, new, grads, failed):
        self.model, self.new, self.grads, self.failed = model, new, grads, failed
        self.gated = model.fastgrad_step_state.drops_nonfinite()
        self.log_keys = requested(model)

    def record_drop(self, where):
        record_drop(self.model, self.new, self.grads, where, self.failed, self.gated)


def record_input_shape(model, new, x):
    """Counts a micro-batch whose first input's shape (rows or element
    count, static under `jit`) differs from the previous one's; only while
    the key is asked."""
    if "input_shape_changes" not in requested(model):
        return
    first = first_input(x)
    rows, size = float(first.shape[0]), float(math.prod(first.shape))
    counters = new.counters
    record(
        new,
        core.Change(
            core.input_shape(counters.last_input_batch, counters.last_input_size, rows, size)
        ),
    )


def measured_keys(model):
    """`StepTelemetry.measured_keys` of the model's step."""
    state = model.fastgrad_step_state
    return state.telemetry.measured_keys(state.options.clip_adaptive)


def measure(model, grads, before, after, counted):
    """`StepTelemetry.measure` of one update: `grads` its gradient after
    adaptive clipping, before `clip_norm`; `before`, `after` the trainable
    values; `counted` the dict `jax_agc.clip` filled (AGC's clipped
    fraction). `{}` when no optional key is requested."""
    telemetry = model.fastgrad_step_state.telemetry
    return telemetry.measure(grads, before, after, counted.get(AGC_CLIPPED_FRACTION))


def unmeasured(model):
    """`measure`'s structure, zeros (the branch without an update)."""
    return {k: ops.zeros((), "float32") for k in measured_keys(model)}


def record_measures(new, measures, entered, applied):
    """Writes `measure`'s values into `new.measured` (`core.measures_after`)."""
    new.measured.update(core.measures_after(new.measured, measures, entered, applied))


def logs(model, slots, new, ov, num_trainable, keys=None, noise=None):
    """The values (float32 scalars, `keras_fastgrad.step.telemetry.logs`)
    of `keys` (default: the requested keys), the noise scale's from `noise`
    (`jax_noise_scale.estimates`; `None`: not measured)."""
    keys = model.fastgrad_step_state.log_keys if keys is None else keys
    scale = slots.loss_scale(ov, 1.0)
    measured = [(k, new.measured[k]) for k in measured_keys(model)]
    return core.logs(new.counters, scale, num_trainable, keys, measured, noise=noise)
