"""The JAX shell's entry points for `FastGradModel`, as Keras'
`backend/jax/trainer.py` is `keras.Model`'s: picked once by
`keras_fastgrad.backend.shell()`, called by the model's Keras hooks.

Each entry point is also defined by the TensorFlow shell's `trainer.py`,
with the same contract (`keras_fastgrad.step.trainer.SHELL_ENTRY_POINTS`). Here:
Keras jits a stateless `train_step(state, data)`
(`keras_fastgrad.backend.jax.step`), the step's variables ride in Keras'
state tuple. What the JAX step does not implement is refused by name, by
the core (`keras_fastgrad.step.trainer`, from `keras_fastgrad.step.support`'s
record).
"""

import functools

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax import state as jax_state
from keras_fastgrad.step import trainer as core
from keras_fastgrad.step.divergence import DivergenceWatch, TrainingLoss
from keras_fastgrad.step.loss_scaling import LossScaling
from keras_fastgrad.step.telemetry import StepTelemetry

# The classes of the step's units that write their own variables
# (`StepState`'s `telemetry`, `divergence`).
STEP_UNIT_CLASSES = (StepTelemetry, DivergenceWatch)
# The loss scaling unit's class (`StepState.scaling`).
LOSS_SCALING = LossScaling

# Whether a model is built before `fit` makes its train function (Keras'
# JAX `fit` builds it before the callbacks attach).
BUILDS_BEFORE_FIT = True

NAME = "jax"
# Keras' JAX trainer methods that read the model's state between batches
# (a plain model's `fit` routes them to the step's: `models.attachment`).
STATE_METHODS = compat.JAX_STATE_METHODS
# No tape: `jax.value_and_grad` differentiates every trainable variable.
TAPE = False
# `jax.jit` traces again for every new input shape (the trace count shows
# each compilation).
RECOMPILES_UNTRACED = False

# `TaskMerger`'s primitives: none. The JAX step merges the tasks itself
# (`jax.vjp`, `backend.jax.multitask`), reading only the merger's
# `aggregator`; a `TaskMerger` called on JAX raises `NotImplementedError`.
MULTITASK = None


# ------------------------------------------------------------------ compile
def loss_tracker(streak):
    """The `loss` metric: a `Mean` that reports NaN while `streak()` (the
    count of micro-batches dropped in a row) is above 0 (`TrainingLoss`,
    the streak's value read by `jax_state.streak_value`)."""
    return TrainingLoss(name="loss", streak=lambda: jax_state.streak_value(streak()))


# ----------------------------------------------------------- train function
def make_train_function(model, make, force):
    """The model's train function, made by `make(force=force)` (Keras' own
    `make_train_function`, which jits `model.train_step`).

    Raises:
        NotImplementedError: for what the JAX step does not implement
            (`step.trainer.check_model`).
    """
    model._fg_prepare_state()
    core.check_model(model, NAME)
    model._fg_keep_for_a_refusal()  # (the step's variables now built)
    # Keras jits `model.train_step`; `jax.jit` caches its traces per
    # function, and bound methods of one model compare equal, so a rebuild
    # would reuse the old trace (the old options, log keys) wherever
    # something still holds the old train function. A new `partial` each
    # time is a new function: traced anew.
    object.__setattr__(model, "train_step", functools.partial(type(model).train_step, model))
    try:
        return make(force=force)
    finally:
        vars(model).pop("train_step", None)


def train_step(model, state, data):
    """The step on Keras' state tuple (`keras_fastgrad.backend.jax.step`):
    returns `(logs, state)` as Keras' JAX trainer expects."""
    from keras_fastgrad.backend.jax import step as jax_step  # imports jax

    result = jax_step.train_step(model, state, data)
    model.fastgrad_step_state.kept_arrays = None  # traced: Keras keeps the state now
    return result


def apply_partial_window(model):
    """The pending window of a compiled `model` applied on its variables,
    then restarted (`keras_fastgrad.backend.jax.window`). Returns the
    telemetry logs as Python floats."""
    from keras_fastgrad.backend.jax import window  # imports jax

    return window.apply_partial_window(model)


# ---------------------------------------------------------------------- fit
def with_divergence_stop(model, args, kwargs):
    """`fit`'s arguments with a `JaxDivergenceStop` added to the callbacks
    (when `max_consecutive_nonfinite` is set), the keras_fastgrad callbacks
    among them checked (`step.trainer.with_divergence_stop`)."""
    from keras_fastgrad.backend import check_callback

    return core.with_divergence_stop(
        model, args, kwargs, jax_state.JaxDivergenceStop, check_callback
    )


def arrays_kept_for_a_refusal(model):
    """The arrays of every variable of Keras' state tuple built so far:
    Keras' JAX `fit` detaches them while it trains, and a refusal raised
    while the first step is traced would leave the variables without values
    (`compat.attached_values`; `fit` gives them back)."""
    optimizer = getattr(model, "optimizer", None)
    variables = [
        *model.trainable_variables,
        *model.non_trainable_variables,
        *(optimizer.variables if optimizer is not None else []),
        *model.metrics_variables,
    ]
    return compat.attached_values(variables)


# --------------------------------------------------------------- readouts
def step_variables(model):
    """The step's own variables, once built: Keras threads only the
    model's four variable lists through its stateless step, so they ride
    in `non_trainable_variables`."""
    return jax_state.step_variables(model)


def tape_variable_count(model):
    """The number of trainable variables `jax.value_and_grad`
    differentiates (all of them) once the train function is made, else
    `None`."""
    return None if model.train_function is None else len(model.trainable_variables)


def trace_count(function):
    """How many times the `jax.jit` function was compiled, or `None` where
    JAX does not say."""
    return compat.jit_cache_size(function)
