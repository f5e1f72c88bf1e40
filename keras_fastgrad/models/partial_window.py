"""A window left partial, applied now (`FastGradModel.apply_partial_window`,
which `fit` calls at every epoch's end): one traced flush of the
accumulated gradient through the end of the step's chain
(`keras_fastgrad.step.train_step.flush`), under the model's strategy."""

import functools

import tensorflow as tf

from keras_fastgrad.step import train_step as _step


def apply_partial_window(model):
    """Applies the pending window of `model` (see
    `FastGradModel.apply_partial_window`). Returns the telemetry logs as
    Python floats, or `None` when nothing was pending."""
    state = model.fastgrad_step_state
    acc = state.accumulator
    if acc is None or int(acc.micro_step.numpy()) % acc.steps == 0:
        return None
    if model.train_function is None:  # loaded, or recompiled: not made yet
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "`apply_partial_window` applies the pending window with the "
                "model's optimizer, and the model is not compiled. Received: "
                f"a model with {int(acc.micro_step.numpy()) % acc.steps} "
                "micro-batches pending and no optimizer. Fix: `compile` it "
                "first (`keras.saving.load_model` compiles a saved model "
                "unless `compile=False`)."
            )
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
