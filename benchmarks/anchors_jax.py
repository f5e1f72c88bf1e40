"""The gated comparator of the target table on Keras' JAX backend (issue 29):
`keras.Model` with Keras' own JAX `train_step` (read from
keras/src/backend/jax/trainer.py, Keras 3.15) line for line, whose
`optimizer.stateless_apply` runs only when every gradient is finite (a
`jax.lax.cond`), the promise `FastGradModel`'s default
(`skip_nonfinite=True`) keeps. The predicate is one sum per gradient,
`isfinite` on their stack (as `anchors.all_finite` on TensorFlow). With
the optimizer's `gradient_accumulation_steps=N`, a non-finite micro-batch
is dropped before it reaches the accumulators, as
`FastGradModel(accumulation_steps=N)` drops it.

Imported under `KERAS_BACKEND=jax` only (`bench_jax.py`, tests/test_anchors_jax.py).
"""

import jax
import keras
from keras import ops


def all_finite(grads):
    """Boolean scalar: every gradient holds only finite values."""
    return ops.all(ops.isfinite(ops.stack([ops.sum(g) for g in grads])))


class JaxGatedModel(keras.Model):
    """`keras.Model` with Keras' own JAX `train_step`, its update applied
    only when every gradient is finite (`gate=False`: exactly Keras' step,
    for checking that this copy of it is faithful)."""

    def __init__(self, *args, gate=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics_variables,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_variables,
        )
        unscaled_loss, y_pred, non_trainable, metrics_variables = aux

        def apply(t, o, g):
            return self.optimizer.stateless_apply(o, g, t)

        if self.gate:
            trainable, optimizer_variables = jax.lax.cond(
                all_finite(grads),
                apply,
                lambda t, o, g: (t, o),
                trainable,
                optimizer_variables,
                grads,
            )
        else:
            trainable, optimizer_variables = apply(trainable, optimizer_variables, grads)
        logs, metrics_variables = self._update_metrics_variables(
            metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)
