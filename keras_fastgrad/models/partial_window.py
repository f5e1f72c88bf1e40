"""A window left partial, applied now (`FastGradModel.apply_partial_window`,
which `fit` calls at every epoch's end): the pending test and the refusal
of an uncompiled model, for both backends, then on TensorFlow one traced
flush of the accumulated gradient through the end of the step's chain
(`keras_fastgrad.step.train_step.flush`), under the model's strategy; on
JAX the pending window's update on values
(`keras_fastgrad.backend.jax.window.apply_partial_window`)."""

import functools

from keras_fastgrad import backend as _backend
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.models.readouts import host_value
from keras_fastgrad.step import train_step as _step


def pending_micro_batches(model):
    """int: the micro-batches accumulated in the open window (0 without
    accumulation, or when the last window was applied)."""
    acc = model.fastgrad_step_state.accumulator
    return 0 if acc is None else int(host_value(acc.micro_step)) % acc.steps


def refuse_without_optimizer(model, pending):
    """Raises `ValueError` when `model` has no optimizer to apply its
    `pending` micro-batches with (loaded with `compile=False`)."""
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`apply_partial_window` applies the pending window with the "
            "model's optimizer, and the model is not compiled. Received: "
            f"a model with {pending} micro-batches pending and no optimizer. "
            "Fix: `compile` it first (`keras.saving.load_model` compiles a "
            "saved model unless `compile=False`)."
        )


def apply_partial_window(model):
    """Applies the pending window of `model` (see
    `FastGradModel.apply_partial_window`). Returns the telemetry logs as
    Python floats, or `None` when nothing was pending."""
    pending = pending_micro_batches(model)
    if not pending:
        return None
    if _backend.is_jax():
        refuse_without_optimizer(model, pending)
        from keras_fastgrad.backend.jax import window as jax_window  # imports jax

        return jax_window.apply_partial_window(model)
    state = model.fastgrad_step_state
    if model.train_function is None:  # loaded, or recompiled: not made yet
        refuse_without_optimizer(model, pending)
        model._fg_prepare_state()
    if state.flush_function is None:
        # A `partial`, not a lambda: TF keys its retracing warning on a
        # function's code, shared by every model's lambda.
        state.flush_function = tf.function(
            functools.partial(model.distribute_strategy.run, _step.flush, args=(model, state)),
            jit_compile=bool(model.jit_compile),
        )
    state.flush_function()
    logs = state.telemetry.logs(state.scaling.current_scale(), state.tape_variables or 0)
    if state.noise_scale is not None:  # the partial window's estimate
        logs.update(state.noise_scale.logs())
    return {k: float(v) for k, v in logs.items()}
