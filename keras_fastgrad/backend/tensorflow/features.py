"""`multitask_space="features"` on TensorFlow: `Z` cut and watched by the
step's persistent tape, the head and trunk passes as `tape.gradient`
calls; the rules (the Gram over `Z`, the cotangents, the kept state) are
`keras_fastgrad.step.multitask`'s (see
`keras_fastgrad.multitask.feature_space`).
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow import multitask as parameter_space
from keras_fastgrad.backend.tensorflow.gradients import to_float32_list
from keras_fastgrad.multitask.representation import Capture
from keras_fastgrad.step import multitask as core


class Step(Capture):
    """The capture of `Z` around the forward pass: each `Z` handed on as
    `stop_gradient(Z)` (`cut`), watched by `tape`; `merge` is
    `TaskMerger.__call__` in `Z` space."""

    def __init__(self, model, tape, task_merger):
        super().__init__(model)
        self.tape, self.task_merger, self.cut = tape, task_merger, []

    def hand_on(self, z, k):
        cut = tf.stop_gradient(z)
        self.tape.watch(cut)
        self.cut.append(cut)
        return cut

    def merge(self, *args, **kwargs):
        """`TaskMerger.__call__` in `Z` space (see `merge_in_z`)."""
        return merge_in_z(self, self.task_merger, *args, **kwargs)


def merge_in_z(
    capture,
    merger,
    tape,
    task_losses,
    regularization,
    variables,
    unscale=None,
    share=None,
    task_names=None,
):
    """Merged float32 gradients, as `TaskMerger.__call__` but in `Z` space.

    Args and returns as `keras_fastgrad.multitask.merger.TaskMerger.__call__`;
    `capture` a `Step` (`Z` and its cut copy), `merger` the aggregator and
    the telemetry variables (`TaskMerger.weigh`).
    """
    capture.check_ran()
    names = core.names_or_default(task_names, len(task_losses))
    merger.build(names)
    unscale = unscale or (lambda grads: grads)
    sources = [v.value for v in variables]
    dz, dz_extra, direct = _head_gradients(
        capture, tape, names, task_losses, regularization, sources
    )
    gram = parameter_space.gram_over_z(dz, unscale, share)  # of the unscaled dZ_t
    weights, info, new_state = merger.weigh(gram)
    cotangents = core.features_cotangents(weights, dz, dz_extra, capture.features)
    trunk = tape.gradient(capture.features, sources, output_gradients=cotangents)  # ONE pass
    grads = parameter_space.add(to_float32_list(unscale(direct)), to_float32_list(unscale(trunk)))
    finite_losses = None
    if merger.aggregator.state_variables:
        finite_losses = parameter_space.losses_finite(task_losses, regularization)
    merger.commit_state(new_state, grads, finite_losses)
    return grads, {"gram": gram, "weights": weights, **info}


def _head_gradients(capture, tape, names, task_losses, regularization, sources):
    """Each task's gradient with respect to `Z` (`dz`, scaled), the
    regularisation's (`dz_extra`, e.g. an activity regulariser on `Z`
    itself), and the gradients of the paths that skip `Z` (`direct`); a
    task whose loss does not reach `Z` (the tape's `None`) is refused."""
    cut, count = capture.cut, len(capture.cut)
    direct, dz = [None] * len(sources), []  # paths that skip Z: plain
    for name, loss in zip(names, task_losses):
        grads = tape.gradient(loss, cut + sources)  # head only
        if any(g is None for g in grads[:count]):
            capture.refuse_task(name)
        dz.append(grads[:count])
        direct = parameter_space.add(direct, grads[count:])
    dz_extra = [None] * count
    if regularization is not None:
        grads = tape.gradient(regularization, cut + sources)
        dz_extra, direct = grads[:count], parameter_space.add(direct, grads[count:])
    return dz, dz_extra, direct
