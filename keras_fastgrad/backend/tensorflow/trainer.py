"""The TensorFlow shell's entry points for `FastGradModel`, as Keras'
`backend/tensorflow/trainer.py` is `keras.Model`'s: picked once by
`keras_fastgrad.backend.shell()`, called by the model's Keras hooks.

Each entry point is also defined by the JAX shell's `trainer.py`, with the
same contract (`keras_fastgrad.backend.SHELL_ENTRY_POINTS`). Here: the step
traced by `tf.function` (its telemetry packed into one output), its state
in variables, the refusals of `tf.distribute`.
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow import log_packing
from keras_fastgrad.backend.tensorflow import train_step as _step
from keras_fastgrad.backend.tensorflow.divergence import DivergenceWatch
from keras_fastgrad.backend.tensorflow.loss_scaling import LossScaling
from keras_fastgrad.backend.tensorflow.telemetry import StepTelemetry
from keras_fastgrad.step.batchnorm import batchnorm_layers, check_synchronized_slices
from keras_fastgrad.step.divergence import DivergenceStop, TrainingLoss

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
# a plain model's `fit` must route to the step's (`models.adapt`): none.
STATE_METHODS = ()
# The gradient is taken with a tape, which watches only the variables the
# step reads (`FastGradModel.tape_variable_count`).
TAPE = True
# Under `jit_compile=True`, a new input shape compiles the step again
# without tracing it again (the trace count does not show it).
RECOMPILES_UNTRACED = True


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
            (`check_strategy`).
    """
    check_strategy(model)
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


# ---------------------------------------------------------------------- fit
def with_divergence_stop(model, args, kwargs):
    """`fit`'s arguments with a `DivergenceStop` (reading the model's
    streak) added to the callbacks, when `max_consecutive_nonfinite` is
    set."""
    if model.max_consecutive_nonfinite is None:
        return args, kwargs
    if len(args) > 5:  # `callbacks` given by position
        return args[:5] + (_add_stop(model, args[5]),) + args[6:], kwargs
    return args, {**kwargs, "callbacks": _add_stop(model, kwargs.get("callbacks"))}


def _add_stop(model, callbacks):
    if callbacks is None:
        callbacks = []
    elif isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = list(callbacks.callbacks)
    else:
        callbacks = list(callbacks)
    state = model.fastgrad_step_state
    return callbacks + [DivergenceStop(lambda: state.divergence)]


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


# ----------------------------------------------------------------- refusals
def compiled(fn, static_argnames=()):
    """`fn` traced once per input signature and run as one graph, eager
    too, inlined in a traced step: `tf.function(autograph=False)` (Python
    arguments retrace; `static_argnames` is JAX's, unused here)."""
    return tf.function(fn, autograph=False)


def check_options(options, defaults):
    """Every option is implemented on TensorFlow: a no-op."""
    del options, defaults


def check_telemetry_keys(keys):
    """Every telemetry key is measured on TensorFlow: a no-op."""
    del keys


def check_callback(callback, model=None):
    """Every keras_fastgrad callback is served on TensorFlow: a no-op."""
    del callback, model


def check_strategy(model):
    """Refuses what the model's `tf.distribute` strategy cannot train.

    Raises:
        ValueError: `jit_compile=True` where XLA cannot compile the
            distributed step, `steps_per_execution > 1` with several
            replicas, any strategy but the default on Keras < 3.10.
    """
    strategy = model.distribute_strategy
    check_jit_compile_under_strategy(model.jit_compile, strategy)
    check_steps_per_execution_under_strategy(model.steps_per_execution, strategy)
    check_keras_supports_replicas(strategy)


def check_jit_compile_under_strategy(jit_compile, strategy):
    """Refuses XLA where TensorFlow cannot compile the distributed step.

    - MirroredStrategy with 2+ devices on this worker: XLA cannot compile one
      function that reads variables placed on several devices (plain
      `keras.Model` fails too, deep in TF: "Trying to access resource ...
      located in device ...").
    - Any multi-replica strategy on CPU devices: XLA has no collectives on
      CPU ("Collectives are not yet implemented for CPU devices when
      compiling with XLA", then a crash of the worker process).
    GPU workers with one device each (MultiWorkerMirroredStrategy) pass.
    """
    if jit_compile is not True or strategy.num_replicas_in_sync == 1:
        return
    try:
        devices = list(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):
        devices = []
    if len(devices) > 1:
        reason = (
            f"with {len(devices)} devices on this worker: XLA cannot compile "
            "a function that reads variables on several devices "
            "(https://www.tensorflow.org/xla/known_issues"
            "#tfvariable_on_a_different_device)"
        )
    elif any("CPU" in d.upper() for d in devices):
        reason = (
            "on CPU devices: XLA has no collectives on CPU (TensorFlow: "
            '"Collectives are not yet implemented for CPU devices when '
            'compiling with XLA")'
        )
    else:
        return
    raise ValueError(
        "`jit_compile=True` is not supported by TensorFlow under "
        f"`{type(strategy).__name__}` {reason}. Received: jit_compile=True. "
        'Fix: compile with `jit_compile=False` (or `"auto"`, which Keras '
        "resolves to False under a strategy)."
    )


def check_steps_per_execution_under_strategy(steps_per_execution, strategy):
    """Refuses `steps_per_execution > 1` with several replicas.

    Keras' multi-step loop (a `tf.while_loop` around `strategy.run`) does
    not run under MirroredStrategy in Keras 3.15 / TF 2.21: plain
    `keras.Model.fit` fails too, with "You must feed a value for
    placeholder tensor 'while/cond/Placeholder'".
    """
    if steps_per_execution > 1 and strategy.num_replicas_in_sync > 1:
        raise ValueError(
            "`steps_per_execution` must be 1 under "
            f"`{type(strategy).__name__}` with "
            f"{strategy.num_replicas_in_sync} replicas: Keras' multi-step "
            'loop fails there (plain `keras.Model.fit` too, with "You must '
            'feed a value for placeholder tensor"). Received: '
            f"steps_per_execution={steps_per_execution}. Fix: compile with "
            "`steps_per_execution=1` (a larger global batch amortises the "
            "per-call cost instead)."
        )


def check_keras_supports_replicas(strategy):
    """Refuses a distribution strategy on Keras < 3.10.

    Before 3.10 Keras creates metric variables mirrored on write: every
    metric update is a `merge_call`, which the step cannot run inside its
    conditional update (TensorFlow: "`merge_call` called while defining a
    new graph or a tf.function"). From 3.10 they are sync-on-read. This
    holds for a strategy of one replica too (a `MirroredStrategy` on a
    machine with one GPU, or none): only the default strategy is free of it.
    """
    if compat.MULTI_REPLICA_SUPPORTED or compat.is_default_strategy(strategy):
        return
    replicas = strategy.num_replicas_in_sync
    raise ValueError(
        "Training a FastGradModel under a distribution strategy needs Keras "
        ">= 3.10: older Keras updates metrics with a `merge_call`, which "
        "the step cannot run inside its conditional update. Received: "
        f"keras=={keras.__version__}, `{type(strategy).__name__}` with "
        f'{replicas} replica(s). Fix: `pip install "keras>=3.10"`, or '
        "train without a strategy."
    )
