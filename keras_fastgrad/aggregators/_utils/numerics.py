"""Machine constants and number checks the aggregators share (`keras.ops`:
the same code on Keras' TensorFlow and JAX backends)."""

import functools

import keras
import numpy as np
from keras import ops

from keras_fastgrad import _compat as compat


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
    """Decorator: `fn` traced once per input signature and run as one
    program, in eager mode too (its loops then run as one program, not op
    by op); inlined where it is called inside a traced step.

    How a backend compiles is the library bridge's (`_compat.compiled`, at
    the first call: `tf.function`, `jax.jit` with `static_argnames`, the
    Python arguments)."""

    def decorate(fn):
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(compat.compiled(fn, static_argnames))
            return compiled[0](*args, **kwargs)

        return call

    return decorate
