"""A window left partial, applied now (`FastGradModel.apply_partial_window`,
which `fit` calls at every epoch's end): the pending test and the refusal of
an uncompiled model, then the backend's flush (the shell's
`apply_partial_window`): the window applied if it holds samples, then
restarted (`step.accumulation`'s rule)."""

from keras_fastgrad import backend as _backend
from keras_fastgrad.models.readouts import host_value
from keras_fastgrad.step import accumulation


def pending_micro_batches(model):
    """int: the micro-batches accumulated in the open window (0 without
    accumulation, or when the last window was applied)."""
    acc = model.fastgrad_step_state.accumulator
    return 0 if acc is None else accumulation.pending(host_value(acc.micro_step), acc.steps)


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
    Python floats (the keys `step.telemetry.partial_window_keys` names,
    on either backend), or `None` when nothing was pending.

    Raises:
        ValueError: when a window is pending and `model` has no optimizer.
    """
    pending = pending_micro_batches(model)
    if not pending:
        return None
    refuse_without_optimizer(model, pending)
    return _backend.shell().apply_partial_window(model)
