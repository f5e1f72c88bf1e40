"""Machine constants and number checks the aggregators share (`keras.ops`:
the same code on Keras' TensorFlow and JAX backends)."""

import keras
import numpy as np
from keras import ops


def _dtype(dtype):
    """The dtype's standard Keras name (`"float32"`), from a TensorFlow,
    NumPy or JAX dtype or a name."""
    return keras.backend.standardize_dtype(dtype)


def _eps(dtype):
    return ops.convert_to_tensor(np.finfo(_dtype(dtype)).eps, _dtype(dtype))


def _tiny(dtype):
    return ops.convert_to_tensor(np.finfo(_dtype(dtype)).tiny, _dtype(dtype))


# Relative cut-off for "zero" eigenvalues in Aligned-MTL in every dtype:
# float32's eps, as the official code (`torch.finfo()`), so that a float64
# Gram of duplicated gradients drops its round-off eigenvalues too.
_RANK_EPS = 1.1920929e-07


def _max_diag(gram):
    """`max(diag G)`, or 1 when it is not positive (`G = 0`)."""
    top = ops.max(ops.diagonal(gram))
    return ops.where(top > 0, top, ops.ones_like(top))


def _finite_or_nan(gram, fn):
    """`fn` on `gram` if it is finite, else NaN weights (`fn` runs on `I`)."""
    num_tasks = gram.shape[0]
    finite = ops.all(ops.isfinite(gram))
    safe = ops.where(finite, gram, ops.eye(num_tasks, dtype=gram.dtype))
    nan = ops.convert_to_tensor(float("nan"), _dtype(gram.dtype))
    return ops.where(finite, fn(safe), nan)


def _compiled(static_argnames=()):
    """Decorator: `fn` traced once per input signature and run as a graph,
    in eager mode too (its loops then run as one program, not op by op);
    inlined where it is called inside a traced step.

    TensorFlow: `tf.function(autograph=False)` (Python arguments retrace);
    JAX: `jax.jit` with `static_argnames` (the Python arguments)."""

    def decorate(fn):
        if keras.backend.backend() == "jax":
            import jax

            return jax.jit(fn, static_argnames=static_argnames)
        import tensorflow as tf

        return tf.function(fn, autograph=False)

    return decorate
