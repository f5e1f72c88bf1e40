"""Keras' per-output `<output>_loss` metrics on TensorFlow, kept as they
were when a micro-batch is dropped.

`CompileLoss` updates them while it computes the loss, before the step
knows whether the micro-batch is finite: their values before the
micro-batch are read in the step's graph (`output_loss_metrics`) and put
back when it is dropped (`keep_output_loss_metrics`), as the `loss`
tracker and the compiled metrics are (a dropped micro-batch's NaN would
make `<output>_loss` NaN for the rest of the epoch). The rest of the loss's
handling is the core's (`keras_fastgrad.step.compile_loss`).
"""

import contextlib

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf


@contextlib.contextmanager
def output_loss_metrics(model):
    """Within the block (the forward passes of one micro-batch), the values
    of Keras' per-output loss metrics' variables before the block's first
    loss computation updates them.

    A model with several outputs and losses has one `Mean` per output in
    `CompileLoss`, updated inside its call; where `CompileLoss` is built
    only by that call (the first trace), the values are read right after
    its build, before its updates (in the graph the block was entered in).

    Yields:
        A list of `(variable, value before)` (filled by the time the block
        ends; empty for a single output: nothing to keep).
    """
    compile_loss = compat.compile_loss(model)
    before = []
    if compile_loss is None:
        yield before
        return

    graph = tf.compat.v1.get_default_graph()

    def read():
        variables = [v for m in compat.output_loss_metrics(compile_loss) for v in m.variables]
        # In the step's graph, also when the first call that builds
        # `CompileLoss` runs inside a loop (`micro_batches`' slices): there
        # the read is created before the loop's op, so it runs before it.
        with graph.as_default():
            before[:] = [(v, tf.identity(v.value)) for v in variables]

    with compat.once_built(compile_loss, read):
        yield before


def keep_output_loss_metrics(before, keep):
    """Puts the per-output loss metrics back to `before` (from
    `output_loss_metrics`) unless `keep`: a dropped micro-batch adds
    nothing to them (its NaN would make `<output>_loss` NaN for the rest of
    the epoch while `loss` stays finite).

    Args:
        before: The list of `(variable, value)` pairs.
        keep: Boolean scalar tensor, `True` (Python: nothing is ever
            dropped, no op) or `False` (Python: inside a drop branch).
    """
    if keep is True:
        return
    for variable, value in before:
        variable.assign(value if keep is False else tf.where(keep, variable.value, value))
