"""The TensorFlow shell's entry points for `FastGradModel`, as Keras'
`backend/tensorflow/trainer.py` is `keras.Model`'s: picked once by
`keras_fastgrad.backend.shell()`, called by the model's Keras hooks.

Each entry point is also defined by the JAX shell's `trainer.py`, with the
same contract (`keras_fastgrad.step.trainer.SHELL_ENTRY_POINTS`). Here: the step
traced by `tf.function` (its telemetry packed into one output), its state
in variables. The refusals (of `tf.distribute` strategies among them)
are the core's (`keras_fastgrad.step.trainer`).
"""

import keras

from keras_fastgrad.backend.tensorflow import log_packing
from keras_fastgrad.backend.tensorflow import multitask as _multitask
from keras_fastgrad.backend.tensorflow import train_step as _step
from keras_fastgrad.backend.tensorflow.loss_scaling import LossScaling
from keras_fastgrad.backend.tensorflow.telemetry import StepTelemetry
from keras_fastgrad.step import trainer as core
from keras_fastgrad.step.batchnorm import batchnorm_layers, check_synchronized_slices
from keras_fastgrad.step.divergence import DivergenceStop, DivergenceWatch, TrainingLoss

# The classes of the step's units that write their own variables
# (`StepState`'s `telemetry`, `divergence`).
STEP_UNIT_CLASSES = (StepTelemetry, DivergenceWatch)
# The loss scaling unit's class (`StepState.scaling`).
LOSS_SCALING = LossScaling

# Whether a model is built before `fit` makes its train function (Keras'
# `fit` builds an unbuilt model in its first trace, after the callbacks
# attached, without a distribution strategy).
BUILDS_BEFORE_FIT = False

NAME = "tensorflow"
# Keras' trainer methods that read the model's state between batches, which
# a plain model's `fit` must route to the step's (`models.attachment`): none.
STATE_METHODS = ()
# The gradient is taken with a tape, which watches only the variables the
# step reads (`FastGradModel.tape_variable_count`).
TAPE = True
# Under `jit_compile=True`, a new input shape compiles the step again
# without tracing it again (the trace count does not show it).
RECOMPILES_UNTRACED = True
# `TaskMerger`'s primitives (`keras_fastgrad.multitask.merger`): the
# tape's task passes, the telemetry and the aggregator's state in variables.
MULTITASK = _multitask


# ------------------------------------------------------------------ compile
def loss_tracker(streak):
    """The `loss` metric: a `Mean` that reports NaN while `streak()` (the
    count of micro-batches dropped in a row) is above 0."""
    return TrainingLoss(name="loss", streak=streak)


# ----------------------------------------------------------- train function
def make_train_function(model, make, force):
    """The model's train function, made by `make(force=force)` (Keras' own
    `make_train_function`) around the step with its telemetry keys packed
    into one output (`backend.tensorflow.log_packing`).

    Raises:
        ValueError: for what the model's `tf.distribute` strategy refuses
            (`step.trainer.check_model`).
    """
    core.check_model(model, NAME)
    check_synchronized_slices(
        batchnorm_layers(model), model.micro_batches, model.distribute_strategy
    )
    model._fg_prepare_state()
    # Keras traces `model.train_step` as it finds it now: the step with its
    # telemetry keys packed into one output, handed back one by one (Keras
    # unpacks every output on the host).
    state = model.fastgrad_step_state
    object.__setattr__(model, "train_step", log_packing.packing_step(model.train_step, state))
    try:
        make(force=force)
    finally:
        vars(model).pop("train_step", None)
    model.train_function = log_packing.unpacking(model.train_function, state)
    return model.train_function


def train_step(model, data):
    """One micro-batch through the chain (`keras_fastgrad.backend.tensorflow.train_step`),
    traced by Keras' `tf.function`: gradients (forward, backward, unscale,
    task merge) -> finite check -> [BatchNorm pooled] moments -> loss-scale
    update -> update or drop in one `cond` (one replica, no accumulation),
    else accumulate and, on a complete window, clip, check, apply. Returns
    the logs (Keras' loss tracker and metrics, then the telemetry keys)."""
    state = model.fastgrad_step_state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch = _step.gradients(model, state, x, y, sample_weight)
    verdict = _step.finite_check(state, batch)
    _step.pool_batchnorm_moments(state, verdict)
    _step.record_small_batches(state, batch, verdict)
    _step.update_loss_scale(state, verdict)
    if _step.single_cond(state):
        logs = _step.update_or_drop(model, state, batch, verdict)
    else:
        _step.accumulate_or_apply(model, state, batch, verdict)
        logs = _step.metrics_logs(model, verdict.keep, batch)
    return _step.with_telemetry(state, logs)


def apply_partial_window(model):
    """The pending window of a compiled `model` applied in one traced flush,
    then restarted (`keras_fastgrad.backend.tensorflow.train_step`), the
    step's state prepared first where no train function made it. Returns
    the telemetry logs as Python floats."""
    if model.train_function is None:  # loaded, or recompiled: not made yet
        model._fg_prepare_state()
    return _step.apply_partial_window(model)


# ---------------------------------------------------------------------- fit
def with_divergence_stop(model, args, kwargs):
    """`fit`'s arguments with a `DivergenceStop` (reading the model's
    streak) added to the callbacks, when `max_consecutive_nonfinite` is
    set (`step.trainer.with_divergence_stop`)."""
    from keras_fastgrad.backend import check_callback

    return core.with_divergence_stop(model, args, kwargs, DivergenceStop, check_callback)


def arrays_kept_for_a_refusal(model):
    """`None`: Keras' TensorFlow `fit` leaves the variables their values."""
    del model
    return None


# --------------------------------------------------------------- readouts
def step_variables(model):
    """The step's variables Keras must thread through the step besides the
    model's own: none (they are variables the traced step assigns)."""
    del model
    return []


def tape_variable_count(model):
    """The number of variables the tape watched in the traced step (`None`
    before the first trace)."""
    return model.fastgrad_step_state.tape_variables


def trace_count(function):
    """How many times the `tf.function` `function` was traced."""
    return function.experimental_get_tracing_count()
