"""Keras' JAX trainer's private API and JAX's own, behind small named
functions: the model methods Keras' JAX `fit` reads the state tuple with,
the arrays it detaches from the variables while it trains, the size of a
`jax.jit` function's cache.

Imports neither JAX nor TensorFlow (the TensorFlow side imports it too).
"""

# Keras' JAX trainer (keras/src/backend/jax/trainer.py, 3.15) reads the
# model's variable lists, for the state it threads through the jitted
# step, in these methods: `fit` calls them between batches, outside the
# train function.
JAX_STATE_METHODS = ("_get_jax_state", "jax_state_sync")


def attached_values(variables):
    """`(variable, array)` pairs of the arrays attached to `variables` now,
    for `reattach`: Keras' JAX `fit` detaches them while it trains
    (`_purge_model_variables`), and an exception raised before its first
    step returns would leave the variables without values."""
    return [(v, v._value) for v in variables]


def reattach(pairs):
    """Attaches each array of `attached_values` back to its variable where
    Keras' JAX `fit` left the variable without one."""
    for variable, value in pairs:
        if variable._value is None and value is not None:
            variable._value = value


def jit_cache_size(function):
    """How many times a `jax.jit` function was compiled (its cache's size,
    a private method of JAX's jitted functions), or `None` where JAX does
    not say."""
    size = getattr(function, "_cache_size", None)
    return size() if callable(size) else None


# The private names of the JAX side (checked under `KERAS_BACKEND=jax` in
# tests/test_compat_jax.py: the canary of tests/test_compat.py runs on
# TensorFlow): (owner, name).
JAX_PRIVATE_NAMES = (
    *(("keras.Model", name) for name in JAX_STATE_METHODS),
    ("keras.Variable()", "_value"),
    ("jax.jit(f)", "_cache_size"),
)
