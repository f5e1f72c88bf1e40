"""What both shells' entry points (`backend/<name>/trainer.py`) ask of
`FastGradModel` the same way, written once: the refusals of options,
models, callbacks and strategies, and the divergence stop added to `fit`.

Which backend refuses what is `keras_fastgrad.step.support`'s record
(`refuses`): a shell passes its name (`trainer.NAME`), never decides a
refusal of its own. The TensorFlow `tf.distribute` refusals read only the
strategy's attributes (no TensorFlow imported): they apply wherever the
model has a `distribute_strategy` (Keras' JAX trainer has none).
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.support import JAX_REFUSALS, REFUSED, refusal


def refuses(key, backend):
    """Whether `backend`'s step (`"tensorflow"` or `"jax"`) refuses the
    feature of `support.BACKEND_SUPPORT`'s row `key` (Python bool).

    >>> refuses("loss_scale_factor", "jax"), refuses("loss_scale_factor", "tensorflow")
    (True, False)
    """
    return getattr(JAX_REFUSALS[key], backend) == REFUSED


# What each shell's `trainer` module defines (same names, same contracts),
# picked once by `keras_fastgrad.backend.shell()`:
SHELL_ENTRY_POINTS = (
    "NAME",  # "tensorflow" or "jax": the Keras backend it runs on
    "STEP_UNIT_CLASSES",  # (telemetry, divergence) classes for `StepState`
    "BUILDS_BEFORE_FIT",  # whether `fit` builds the model before its train function
    "LOSS_SCALING",  # the loss scaling unit's class (`StepState.scaling`)
    "STATE_METHODS",  # Keras' trainer methods reading the state between batches
    "TAPE",  # whether gradients come from a tape watching a subset of variables
    "RECOMPILES_UNTRACED",  # whether a new input shape recompiles without a retrace
    "MULTITASK",  # `TaskMerger`'s primitives (the protocol in `multitask.merger`)
    "loss_tracker",  # (streak) -> the `loss` metric, NaN while micro-batches drop
    "make_train_function",  # (model, make, force) -> Keras' train function, the step in it
    "train_step",  # (model, *Keras' train_step arguments) -> the step's result
    "apply_partial_window",  # (compiled model) -> the pending window applied, its logs
    "with_divergence_stop",  # (model, args, kwargs) -> `fit`'s arguments, the stop added
    "arrays_kept_for_a_refusal",  # (model) -> what `fit` gives back if tracing raises
    "step_variables",  # (model) -> the step's variables Keras must thread
    "tape_variable_count",  # (model) -> variables differentiated, or None
    "trace_count",  # (the compiled step function) -> times traced/compiled
)


# ------------------------------------------------------------ options, keys
def check_options(options, defaults, backend):
    """Refuses the options `backend`'s step does not implement: those whose
    support row (keyed by the option's name) marks them refused there,
    set to other than their defaults.

    Args:
        options: Dict of `FastGradModel`'s options.
        defaults: Dict of their default values.
        backend: The shell's `NAME`.

    Raises:
        NotImplementedError: naming the option (`support.refusal`).

    Example:

    >>> check_options({"clip_norm": 1.0}, {"clip_norm": None}, "jax")  # supported
    """
    for name, value in options.items():
        if name in JAX_REFUSALS and refuses(name, backend) and value != defaults[name]:
            raise refusal(name, f"{name}={value!r}")


def check_callback(callback, model, backend):
    """Refuses a keras_fastgrad callback `backend`'s step does not serve:
    one whose support row (keyed by its class name) marks it refused there.

    Args:
        callback: The callback.
        model: The model it attaches to, or `None` (not known yet).
        backend: The shell's `NAME`.

    Raises:
        NotImplementedError: naming the callback.
    """
    del model  # (every callback serves every model, on both backends)
    name = type(callback).__name__
    if name in JAX_REFUSALS and refuses(name, backend):
        raise refusal(name, f"{name}(...)")


# -------------------------------------------------------------------- model
def check_model(model, backend):
    """Refuses what training `model` would need of the backend's step
    beyond what it supports: a `tf.distribute` strategy TensorFlow cannot
    run (`check_strategy`, where the model has one); an optimizer's fixed
    `loss_scale_factor` (where the support record refuses it). Read when
    the train function is made.

    Raises:
        ValueError: for a strategy (`check_strategy`).
        NotImplementedError: naming the feature (`support.refusal`).
    """
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None:
        check_strategy(model, strategy)
    # (A `keras.distribution` needs no check: the step's arrays are global,
    # sharded over the batch or the model, so its sums, counts and norms
    # are the whole batch's and the whole model's as they stand.)
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    factor = getattr(inner, "loss_scale_factor", None)
    if factor is not None and refuses("loss_scale_factor", backend):
        raise refusal("loss_scale_factor", f"loss_scale_factor={factor!r}")


def check_trainable_unchanged(model):
    """Refuses trainable variables other than those the step's state, and
    the optimizer, were built for (read when a stateless step is traced).
    On TensorFlow the traced step keeps training the variables it was
    traced with (and `TapeVariableCounter` warns), and a layer may create
    variables in its first training call; Keras' JAX step takes the
    trainable values anew each call and cannot create variables:
    `keras.Model` fails there too, in the optimizer.

    Raises:
        ValueError: naming the counts, the likely cause and the fix.
    """
    built = len(model.fastgrad_step_state.telemetry.layer_of_variable)
    now = len(model.trainable_variables)
    if now == built:
        return
    frozen = [layer.name for layer in model.layers if layer.weights and not layer.trainable]
    if now < built:
        cause = f"a layer's `trainable` set to False without a new `compile`; frozen layers now: {frozen}"
        fix = "call `model.compile(...)` again after changing `trainable`"
    else:
        cause = (
            "a layer made variables inside the train step, e.g. one used only "
            "with `training=True`, or a layer's `trainable` set to True "
            "without a new `compile`"
        )
        fix = (
            "make every variable before `fit` (call the model once on a batch "
            "with `training=True`, or create them in the layer's `build`), and "
            "call `model.compile(...)` again after changing `trainable`"
        )
    raise ValueError(
        "The model's trainable variables changed after the step was built: "
        f"the step and the optimizer were built for {built}, the model now has "
        f"{now} ({cause}). Keras' JAX step cannot train other variables than "
        "those (`keras.Model` fails here too). Received: "
        f"{now} trainable variables, built for {built}. Fix: {fix}."
    )


# ---------------------------------------------------------- tf.distribute
def check_strategy(model, strategy):
    """Refuses what the model's `tf.distribute` `strategy` cannot train.

    Raises:
        ValueError: `jit_compile=True` where XLA cannot compile the
            distributed step, `steps_per_execution > 1` with several
            replicas, any strategy but the default on Keras < 3.10.
    """
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


# ---------------------------------------------------------------------- fit
def with_divergence_stop(model, args, kwargs, stop, check_callback):
    """`fit`'s arguments with a divergence stop added to its callbacks
    (when `max_consecutive_nonfinite` is set), the keras_fastgrad
    callbacks among them checked first.

    Args:
        model: The `FastGradModel`.
        args: `fit`'s positional arguments (`callbacks` the sixth).
        kwargs: Its keyword arguments.
        stop: The shell's `DivergenceStop` class, made with a callable
            returning the step's `DivergenceWatch`.
        check_callback: `(callback) -> None`, refusing a callback the
            backend's step does not serve.

    Returns:
        `(args, kwargs)`: as given when nothing is added.
    """
    position = len(args) > 5
    given = args[5] if position else kwargs.get("callbacks")
    if isinstance(given, keras.callbacks.CallbackList):
        given = list(given.callbacks)
    callbacks = list(given or [])
    for callback in callbacks:
        # By module (`callbacks` sits above `models`, which imports this).
        if type(callback).__module__.startswith("keras_fastgrad.callbacks"):
            check_callback(callback)
    if model.max_consecutive_nonfinite is None:
        return args, kwargs
    state = model.fastgrad_step_state
    callbacks.append(stop(lambda: state.divergence))
    if position:
        return args[:5] + (callbacks,) + args[6:], kwargs
    return args, {**kwargs, "callbacks": callbacks}
