"""`multitask_space="features"` on Keras' JAX backend: the tasks merged in
the shared representation `Z`, as on TensorFlow
(`keras_fastgrad.multitask.feature_space`; MGDA-UB's "upper bound").

The shared layer (`multitask_features`, or the deepest tensor every output
depends on: `representation.find_features`) is captured during the forward
pass, and its output `Z` handed on as `stop_gradient(Z) + delta`, `delta`
an input of zeros: one forward pass (`jax.vjp` of `(trainable, delta) ->
(losses, Z)`, traced once: a task whose loss does not read `Z` is refused
from the trace, as TensorFlow refuses it from the tape's `None`) then

1. one pullback per task (heads only): `dL_t / delta = dL_t / dZ` and the
   gradient of the paths that skip `Z` (the heads', a tied variable's
   direct part), the regularisation's likewise;
2. `core.merge_features`: the Gram matrix `G[s, t] = <dZ_s, dZ_t>`
   (divided by `D_j^2` when accumulating), the aggregator's weights `w`
   (`jax_multitask.weighing`), then ONE trunk pullback with the
   cotangent `sum_t w_t dZ_t` (plus the regularisation's `dZ`) on `Z`:
   the trunk gets `sum_t w_t dL_t / dtheta`; the heads keep their plain
   gradients.

Imported by the JAX step only for a model in features space (the shared
layer's capture is `keras_fastgrad.multitask.representation`'s).
"""

import jax
from keras import ops

from keras_fastgrad.backend.jax import forward as jax_forward
from keras_fastgrad.backend.jax import multitask as parameter_space
from keras_fastgrad.backend.jax import reaching as jax_reaching
from keras_fastgrad.maths.finite import all_finite
from keras_fastgrad.multitask import representation
from keras_fastgrad.step import multitask as core
from keras_fastgrad.step.task_losses import task_names


def gradients(model, slots, state, x, y, sample_weight, accumulating, check_extra_terms):
    """As `jax_multitask.gradients`, merged in `Z` space."""
    tv, ntv = state[0], state[1]
    cut = _Cut(model)

    def program(trainable, deltas):
        cut.begin(deltas)
        with cut:
            losses, aux = losses_program(trainable)
        return (losses, tuple(cut.features)), aux

    losses_program, found, scale = parameter_space.losses_program(
        model, slots, state, x, y, sample_weight, accumulating, check_extra_terms
    )
    shapes = jax.eval_shape(lambda t: program(t, None)[0][1], list(tv))
    zeros = tuple(ops.zeros(s.shape, s.dtype) for s in shapes)
    closed, traced = jax_reaching.traced_program(program, list(tv), zeros)
    names = task_names(model)
    num_tasks = len(names)
    _check_every_task_reads_z(closed, names, len(tv), len(zeros), cut)
    (losses, features), pullback, (aux, d) = jax.vjp(traced, list(tv), zeros, has_aux=True)
    no_features = tuple(ops.zeros_like(z) for z in features)
    direct, dz = None, []
    for i in range(len(losses)):  # heads only: one pullback per task
        grads, dz_i = pullback((parameter_space.one_hot(losses, i), no_features))
        direct = grads if direct is None else [a + b for a, b in zip(direct, grads)]
        dz.append(dz_i)
    no_losses = tuple(ops.zeros_like(v) for v in losses)

    def trunk(cotangent):  # ONE trunk pass; the paths that skip Z keep theirs
        grads, _ = pullback((no_losses, tuple(cotangent)))
        return jax_forward.unscaled([a + b for a, b in zip(direct, grads)], d, scale)

    weigh, old_state, updates = parameter_space.weighing(model, ntv)
    result = core.merge_features(  # the true gradients' Gram (the merge keeps D_j)
        dz[:num_tasks],
        dz[num_tasks] if len(dz) > num_tasks else [None] * len(features),
        features,
        weigh,
        trunk,
        factor=None if scale is None else d / ops.cast(scale, "float32"),
        share=ops.cast(d, "float32") if accumulating else None,
        state=old_state,
        losses_finite=all_finite(list(losses)),
    )
    aux = parameter_space.with_updates(model, aux, updates(result.new_state), result.gram)
    return result.grads, d, found["mean"], aux


def _check_every_task_reads_z(closed, names, num_trainable, num_features, cut):
    """Refuses (trace time) a shared layer some task's loss does not read,
    read from the traced program (`jax_reaching`), whose inputs are the
    trainable values then the `Z` offsets, its first outputs the task
    losses (TensorFlow reads it from the tape's `None`)."""
    reached = jax_reaching.reaching_inputs(closed, len(names))
    for name, inputs in zip(names, reached):
        if any(num_trainable + k not in inputs for k in range(num_features)):
            cut.refuse_task(name)


class _Cut(representation.Capture):
    """While active: the shared layer's floating outputs `Z` recorded and
    handed on as `stop_gradient(Z) + delta` (after `begin(deltas)`; as they
    are while `deltas` is `None`: only their shapes are read)."""

    def __init__(self, model):
        super().__init__(model)
        self.deltas = None

    def begin(self, deltas):
        self.deltas, self.features, self.calls = deltas, [], 0

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.check_ran()

    def hand_on(self, z, k):
        if self.deltas is None:
            return z
        return jax.lax.stop_gradient(z) + self.deltas[k]
