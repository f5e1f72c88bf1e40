"""Multi-task merging in representation space (`multitask_space="features"`).

The parameter-space merge (`keras_fastgrad.multitask`) differentiates every
task down to the first layer: `T` backward passes through the trunk. Here the
aggregator sees the gradients with respect to the shared representation `Z`
(the trunk's output) instead, as MGDA-UB does (Sener & Koltun 2018, "upper
bound"; LibMTL's `rep_grad`):

1. one forward pass; the output `Z` of the shared layer is cut from the graph
   (`stop_gradient`) and watched, so each task's backward stops at `Z`:
   `dZ_t = dL_t / dZ`, head only;
2. the Gram matrix `G[s, t] = <dZ_s, dZ_t>` (summed over the batch and over
   the replicas: the global batch's `Z` is the replicas' rows stacked) goes
   to the aggregator, whose weights `w` are constants;
3. ONE trunk backward pass with the cotangent `sum_t w_t dZ_t`: the trunk
   gets `sum_t w_t dL_t/dtheta` (for fixed `w` the exact gradient of
   `sum_t w_t L_t`: only the weights are approximated);
4. every path that does not pass through `Z` keeps its plain gradient: the
   heads get `sum_t dL_t/dphi`; a variable used both upstream of `Z` and
   directly by a head (a tied embedding) gets its merged part through `Z`
   plus its plain direct part; the regularisation gradient is added as in
   parameter space.

Cost: `T` head backward passes and one trunk backward pass, against `T`
full backward passes in parameter space.

Finding `Z`: `FastGradModel(multitask_features="layer_name")` names the
layer whose output is `Z` (all its floating outputs; needed for subclassed
models). Otherwise, for a functional model, `Z` is the deepest tensor every
model output depends on (`find_features`). The layer must run once per
forward pass; its output is captured by wrapping its `call` for the duration
of the step's forward pass (at trace time: no cost per step).

Example:

>>> inputs = keras.Input((4,))
>>> trunk = keras.layers.Dense(8, activation="tanh", name="trunk")(inputs)
>>> outputs = {"a": keras.layers.Dense(1, name="a")(trunk),
...            "b": keras.layers.Dense(1, name="b")(trunk)}
>>> model = keras_fastgrad.FastGradModel(
...     inputs, outputs, multitask="mgda", multitask_space="features")
>>> find_features(model)
('trunk', 0)
>>> model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
>>> x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
>>> history = model.fit(x, {"a": x[:, :1], "b": -x[:, :1]}, verbose=0)

References:
    Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization",
    NeurIPS 2018, https://arxiv.org/abs/1810.04650 (Section 3.3, MGDA-UB).
    Lin & Zhang, "LibMTL: A Python Library for Multi-Task Learning", JMLR
    2023 (`rep_grad=True`).
"""

import contextlib

from keras_fastgrad.backend.tensorflow import multitask as shell
from keras_fastgrad.multitask.representation import Capture, find_features  # noqa: F401
from keras_fastgrad.step import multitask as core
from keras_fastgrad.step.gradients import to_float32_list

SPACES = ("parameters", "features")


def capture(model, tape, task_merger):
    """The context around the forward pass (`Capture(model, tape)` in
    features space, else a no-op); its `merge` has `TaskMerger.__call__`'s
    signature and merges in the space chosen (`task_merger` itself in
    parameter space)."""
    if getattr(model, "multitask_space", "parameters") != "features":
        return _NoCapture(task_merger)
    return _Step(model, tape, task_merger)


class _NoCapture(contextlib.nullcontext):
    def __init__(self, task_merger):
        super().__init__()
        self.merge = task_merger


class _Step(Capture):
    def __init__(self, model, tape, task_merger):
        super().__init__(model, tape)
        self.task_merger = task_merger

    def merge(self, *args, **kwargs):
        """`TaskMerger.__call__` in `Z` space (see `merge`)."""
        return merge(self, self.task_merger, *args, **kwargs)


# ------------------------------------------------------------------ merge
def merge(
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
    `capture` holds `Z` and its cut copy, `merger` the aggregator and the
    telemetry variables (`TaskMerger.weigh`).
    """
    if not capture.cut:
        raise ValueError(
            "`multitask_features` must name a layer that runs in the forward "
            f"pass. Received: multitask_features={capture.layer.name!r}, "
            "which did not run. Fix: name the trunk's last layer."
        )
    names = core.names_or_default(task_names, len(task_losses))
    merger.build(names)
    unscale = unscale or (lambda grads: grads)
    sources = [v.value for v in variables]
    dz, dz_extra, direct = _head_gradients(
        capture, tape, names, task_losses, regularization, sources
    )
    gram = shell.features_gram(dz, unscale, share)  # over Z, of the unscaled dZ_t
    weights, info, new_state = merger.weigh(gram)
    cotangents = core.features_cotangents(weights, dz, dz_extra, capture.features)
    trunk = tape.gradient(capture.features, sources, output_gradients=cotangents)  # ONE pass
    grads = shell.add(to_float32_list(unscale(direct)), to_float32_list(unscale(trunk)))
    finite_losses = None
    if merger.aggregator.state_variables:
        finite_losses = shell.losses_finite(task_losses, regularization)
    merger.commit_state(new_state, grads, finite_losses)
    return grads, {"gram": gram, "weights": weights, **info}


def _head_gradients(capture, tape, names, task_losses, regularization, sources):
    """Each task's gradient with respect to `Z` (`dz`, scaled), the
    regularisation's (`dz_extra`, e.g. an activity regulariser on `Z`
    itself), and the gradients of the paths that skip `Z` (`direct`)."""
    cut, count = capture.cut, len(capture.cut)
    direct, dz = [None] * len(sources), []  # paths that skip Z: plain
    for name, loss in zip(names, task_losses):
        grads = tape.gradient(loss, cut + sources)  # head only
        if any(g is None for g in grads[:count]):
            raise ValueError(
                "`multitask_features` must name a layer on every task's path. "
                f"Received: multitask_features={capture.layer.name!r}; task "
                f"{name!r} does not read its output. Fix: name a layer all "
                "outputs depend on (the trunk's last layer)."
            )
        dz.append(grads[:count])
        direct = shell.add(direct, grads[count:])
    dz_extra = [None] * count
    if regularization is not None:
        grads = tape.gradient(regularization, cut + sources)
        dz_extra, direct = grads[:count], shell.add(direct, grads[count:])
    return dz, dz_extra, direct
