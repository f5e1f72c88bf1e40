"""`multitask_space="features"` on TensorFlow: `Z` cut and watched by the
step's persistent tape, the head and trunk passes as `tape.gradient`
calls; the merge (the Gram over `Z`, the cotangents, the kept state) is
`keras_fastgrad.step.multitask.merge_features` (see
`keras_fastgrad.multitask.feature_space`).
"""

import contextlib
import functools

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import add, rows_gram, to_float32_list, values
from keras_fastgrad.backend.tensorflow.replicas import num_replicas, replica_sum
from keras_fastgrad.multitask.representation import Capture
from keras_fastgrad.step import multitask as core


def capture(model, tape, task_merger):
    """The context around the TensorFlow step's forward pass (in features
    space, a `Step`: `Z` captured, watched by `tape`; else a no-op); its
    `merge` has `TaskMerger.__call__`'s signature and merges in the space
    chosen (`task_merger` itself in parameter space)."""
    if getattr(model, "multitask_space", "parameters") != "features":
        return _InParameters(task_merger)
    return Step(model, tape, task_merger)


class _InParameters(contextlib.nullcontext):
    def __init__(self, task_merger):
        super().__init__()
        self.merge = task_merger


class Step(Capture):
    """The capture of `Z` around the forward pass: each `Z` handed on as
    `stop_gradient(Z)` (`cut`), watched by `tape`; `merge` is
    `TaskMerger.__call__` in `Z` space (`capture=self`)."""

    def __init__(self, model, tape, task_merger):
        super().__init__(model)
        self.tape, self.cut = tape, []
        self.merge = functools.partial(task_merger, capture=self)

    def hand_on(self, z, k):
        cut = tf.stop_gradient(z)
        self.tape.watch(cut)
        self.cut.append(cut)
        return cut


def merge_in_z(
    capture, tape, names, task_losses, regularization, variables, unscale, weigh, **kwargs
):
    """`core.merge_features` of the tape's passes (`TaskMerger.__call__`
    with a `capture`).

    Args:
        capture: A `Step` (`Z` and its cut copy).
        tape: The persistent `tf.GradientTape` that recorded the losses.
        names: The task names (a task not reading `Z` is refused by name).
        task_losses, regularization, variables: As `TaskMerger.__call__`'s.
        unscale: `None` or a callable mapping a gradient list to the
            gradients of the unscaled losses.
        weigh: `weigh(gram) -> (weights, new_state)`, the aggregator's.
        **kwargs: `share`, `state`, `losses_finite`, as
            `core.merge_features`'.

    Returns:
        A `core.TaskMerge`.
    """
    capture.check_ran()
    unscale = unscale or (lambda grads: grads)
    sources = [v.value for v in variables]
    dz, dz_extra, direct = _head_gradients(
        capture, tape, names, task_losses, regularization, sources
    )

    def trunk(cotangents):  # ONE pass; the paths that skip Z keep theirs
        grads = tape.gradient(capture.features, sources, output_gradients=cotangents)
        return add(to_float32_list(unscale(direct)), to_float32_list(unscale(grads)))

    several = num_replicas() > 1
    return core.merge_features(
        dz,
        dz_extra,
        capture.features,
        weigh,
        trunk,
        unscale=lambda d: to_float32_list(unscale(d)),
        replica_sum=replica_sum if several else None,
        rows_gram=rows_gram,
        stored=values,
        **kwargs,
    )


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
        direct = add(direct, grads[count:])
    dz_extra = [None] * count
    if regularization is not None:
        grads = tape.gradient(regularization, cut + sources)
        dz_extra, direct = grads[:count], add(direct, grads[count:])
    return dz, dz_extra, direct
