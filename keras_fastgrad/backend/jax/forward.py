"""Keras' stateless forward and loss on the state's values, as the JAX
step's gradients take them (`jax_micro_batches.gradient`, the multi-task
`jax_multitask.losses_program`) and the model's own loss, where a subclass
overrides it (`keras_loss`): the forward
(`stateless_call(..., return_losses=True)`), the loss computed in a
`keras.StatelessScope` that maps the model's variables to the forward's
values (the metrics' updates read back from it), and the loss scaled for
the gradient and the gradient unscaled after it."""

import keras
from keras import ops

from keras_fastgrad import _compat as compat


def stateless_loss(model, values, x, loss_of):
    """Keras' JAX forward on `values`, then `loss_of` in its scope.

    Args:
        model: The `FastGradModel`.
        values: `(trainable, non_trainable, metrics)` values.
        x: The (micro-)batch's inputs.
        loss_of: `(y_pred, losses) -> result`, called inside a
            `keras.StatelessScope` mapping the model's variables to the
            forward's values (`losses`: the forward's `model.losses`, the
            layers' losses then one weight penalty per regularised
            variable).

    Returns:
        `(result, y_pred, non_trainable, metrics)`: `loss_of`'s result,
        the predictions and the non-trainable and metrics values as the
        forward and the loss left them.
    """
    trainable, ntv, mv = values
    kwargs = {"training": True} if compat.call_has_training_arg(model) else {}
    y_pred, ntv, losses = model.stateless_call(trainable, ntv, x, return_losses=True, **kwargs)
    mapping = [
        *zip(model.trainable_variables, trainable),
        *zip(model.non_trainable_variables, ntv),
        *zip(model.metrics_variables, mv),
    ]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        result = loss_of(y_pred, losses)
    after = [current(scope, v) for v in (*model.non_trainable_variables, *model.metrics_variables)]
    return result, y_pred, after[: len(ntv)], after[len(ntv) :]


def keras_loss(model, values, batch):
    """The model's `compute_loss_and_updates` (Keras' JAX trainer's, or a
    subclass's own) on `values`, `(trainable, non_trainable, metrics,
    optimizer)`, and `batch`, `(x, y, sample_weight)`, in training.

    Returns:
        `(loss, (unscaled_loss, y_pred, non_trainable, metrics))`.
    """
    trainable, ntv, mv, ov = values
    return model.compute_loss_and_updates(
        trainable, ntv, mv, *batch, training=True, optimizer_variables=ov
    )


def current(scope, variable):
    """`variable`'s value in `scope` (a `keras.StatelessScope`), or its
    own value where the scope does not map it."""
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


def scaled(losses, d, scale, weighed):
    """The losses as differentiated: times the loss scale (`None`: no loss
    scaling), else, `weighed`, times the share `D`; as they are else."""
    if scale is None and not weighed:
        return losses
    factor = d if scale is None else scale
    return [loss * ops.cast(factor, loss.dtype) for loss in losses]


def unscaled(grads, d, scale):
    """float32 gradients of the unscaled losses (times `D`, accumulating)
    from those of `scaled`'s."""
    grads = [ops.cast(g, "float32") for g in grads]
    if scale is None:
        return grads
    factor = d / ops.cast(scale, "float32")
    return [g * factor for g in grads]
