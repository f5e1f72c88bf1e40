"""The per-task losses of a compiled multi-output model.

A model compiled with one loss per output has one task per output loss
(times its loss weight); the weight regularisation and the layers' own
losses (`model.losses`) are not a task. The multi-task step differentiates
each task on its own (`keras_fastgrad.multitask.TaskMerger` merges the
gradients): these helpers give it the task losses, their names and the
regularisation, from the model's own `CompileLoss`
(`compile_loss.wrapped_output_losses`), so Keras' structure matching and
its `<output>_loss` metrics stay as in `keras.Model`.

They live in the step (not in `keras_fastgrad.multitask`) because the step
computes the losses inside its tape; `multitask` builds on the step, never
the other way round.
"""

import keras
from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.compile_loss import wrapped_output_losses


class _Recording:
    """Wraps one of `CompileLoss`'s losses and keeps what it returns."""

    def __init__(self, loss_fn, sink):
        self.loss_fn, self.sink = loss_fn, sink

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = self.loss_fn(y_true, y_pred, sample_weight)
        self.sink.append(value)
        return value


def task_losses(model, y, y_pred, sample_weight=None):
    """The per-task losses of a compiled multi-output model.

    Runs the model's own `CompileLoss` (so `y` / `sample_weight` structures
    are matched exactly as in Keras, and the per-output `<name>_loss`
    metrics update as usual) while recording each output loss, then applies
    the loss weight the same way `CompileLoss` does. Hence
    `sum(task_losses(...)) + regularization_loss(model)` equals
    `model.compute_loss(...)` up to float rounding. Call it inside the tape.

    Args:
        model: A compiled `keras.Model`.
        y: Targets, as passed to `fit`.
        y_pred: The model's outputs on the batch.
        sample_weight: Optional sample weights, as passed to `fit`.

    Returns:
        A list of scalar tensors, one per compiled output loss, in the order
        of `task_names(model)`.

    Raises:
        ValueError: if the model has fewer than two task losses.

    Example:

    >>> inputs = keras.Input((3,))
    >>> a = keras.layers.Dense(1, name="a")(inputs)
    >>> b = keras.layers.Dense(1, name="b")(inputs)
    >>> model = keras.Model(inputs, {"a": a, "b": b})
    >>> model.compile(loss={"a": "mse", "b": "mae"}, loss_weights={"a": 1.0, "b": 0.5})
    >>> x = np.ones((4, 3), "float32")
    >>> y = {"a": np.zeros((4, 1), "float32"), "b": np.zeros((4, 1), "float32")}
    >>> y_pred = model(x)
    >>> losses = task_losses(model, y, y_pred)
    >>> task_names(model)
    ['a', 'b']
    >>> total = model.compute_loss(x, y, y_pred)
    >>> bool(abs(float(losses[0] + losses[1]) - float(total)) < 1e-6)
    True
    """
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        raise_too_few_tasks(model, 0)
    recorded = []
    with wrapped_output_losses(model, lambda entry: _Recording(entry.loss, recorded)) as unwrapped:
        compile_loss(y, y_pred, sample_weight)
    if not tree.is_nested(y) and not tree.is_nested(y_pred):
        recorded = recorded[:1]  # Keras' single-output path uses one loss
    if len(recorded) < 2:
        raise_too_few_tasks(model, len(recorded))
    losses = []
    for value, entry in zip(recorded, unwrapped):
        value = keras.ops.cast(value, dtype=compile_loss.dtype)
        if entry.loss_weights is not None:
            value = keras.ops.multiply(value, entry.loss_weights)
        losses.append(value)
    return losses


def task_names(model):
    """The task names (the output loss names), once the losses are built."""
    return [entry.name for entry in compat.output_losses(compat.compile_loss(model))]


def regularization_loss(model):
    """The sum of `model.losses` (regularisers, `add_loss`) or `None`.

    Scaled for distribution as in `keras.Model.compute_loss`. Call it inside
    the tape, after the forward pass.
    """
    losses = [compat.additional_loss(model, loss) for loss in model.losses]
    if not losses:
        return None
    return losses[0] if len(losses) == 1 else keras.ops.sum(losses)


def check_task_count(model, aggregator=None):
    """Raises at `compile` if `model.multitask` (or `aggregator`, for a
    model not yet given it: `fastgrad`) cannot apply.

    The count is known at compile time for functional models; otherwise the
    first trace of the train step checks it (`task_losses`).

    Raises:
        ValueError: if `compute_loss` is overridden (the tasks are the
            compiled losses) or the model has fewer than two task losses.
    """
    if type(model).compute_loss is not keras.Model.compute_loss:
        raise ValueError(
            f"`multitask={_method(model, aggregator)}` merges the compiled output losses, "
            f"but `{type(model).__name__}` overrides `compute_loss`, which "
            "the multi-task step does not call. Fix: compile one loss per "
            "output instead of overriding `compute_loss`, or use "
            "`multitask=None`."
        )
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        raise_too_few_tasks(model, 0, aggregator)
    outputs = getattr(model, "outputs", None)
    if not outputs:
        return  # not known before the first call (subclassed model)
    loss = compat.user_loss(compile_loss)
    num_outputs = len(tree.flatten(outputs))
    if num_outputs == 1:
        count = 1
    elif not tree.is_nested(loss):
        count = num_outputs  # one loss applied to every output
    else:
        count = len([x for x in tree.flatten(loss) if x is not None])
    if count < 2:
        raise_too_few_tasks(model, count, aggregator)


def _method(model, aggregator=None):
    aggregator = model.multitask if aggregator is None else aggregator
    return repr(aggregator.name) if aggregator.name else repr(aggregator)


def raise_too_few_tasks(model, count, aggregator=None):
    """Raises the `ValueError` for a multi-task `model` (or `aggregator`,
    for a model not yet given it) with `count < 2` task losses."""
    names = list(getattr(model, "output_names", None) or [])
    compile_loss = compat.compile_loss(model)
    loss = None if compile_loss is None else compat.user_loss(compile_loss)
    raise ValueError(
        f"`multitask={_method(model, aggregator)}`: a multi-task method needs at least two "
        "task losses (one compiled loss per model output). This model has "
        f"{count} task loss{'es' if count != 1 else ''} (outputs: {names}, "
        f"compiled loss: {loss!r}). Fix: give the model several outputs and "
        "compile one loss per output, e.g. `loss={'a': 'mse', 'b': "
        "'mse'}`, or use `multitask=None`."
    )
