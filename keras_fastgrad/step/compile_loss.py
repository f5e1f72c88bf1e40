"""The one place that reaches into Keras' `CompileLoss` output losses.

`CompileLoss` matches `y`, `y_pred` and `sample_weight` structures and then
calls one loss object per output (`compat.output_losses`). The step needs to see
each of those calls (the per-task values for multi-task merging, the loss
normalisers for exact weighting) without re-implementing the matching: it
swaps the loss objects for wrappers while the model computes its loss.
"""

import contextlib

from keras_fastgrad import _compat as compat


@contextlib.contextmanager
def wrapped_output_losses(model, wrap):
    """Within the block, each output loss `entry.loss` is `wrap(entry)`.

    Nests: an inner block wraps the outer block's wrappers. Works before
    `CompileLoss` is built (it builds on its first call): the wrappers are
    installed right after that build.

    Args:
        model: A compiled `keras.Model` (without compiled loss: no-op).
        wrap: Callable `entry -> callable(y_true, y_pred, sample_weight)`;
            `entry` has `path`, `loss`, `loss_weights`, `name`.

    Yields:
        The list of the original entries (filled once installed).
    """
    compile_loss = compat.compile_loss(model)
    originals = []
    if compile_loss is None:
        yield originals
        return

    def install():
        originals[:] = compat.output_losses(compile_loss)
        compat.set_output_losses(
            compile_loss, [entry._replace(loss=wrap(entry)) for entry in originals]
        )

    try:
        with compat.once_built(compile_loss, install):
            yield originals
    finally:
        if originals:
            compat.set_output_losses(compile_loss, originals)
