"""The private names keras_fastgrad reads on the JAX side exist in the
installed Keras and JAX (`_compat.JAX_PRIVATE_NAMES`; tests/test_compat.py
is the TensorFlow side's canary)."""

import jax
import keras
import pytest

from keras_fastgrad import _compat as compat


def owner(name):
    if name == "jax.jit(f)":
        return jax.jit(lambda v: v)
    if name == "keras.Variable()":
        return keras.Variable(1.0)
    assert name == "keras.Model", name
    return keras.Model


@pytest.mark.parametrize("owner_name, name", compat.JAX_PRIVATE_NAMES)
def test_jax_private_name_exists(owner_name, name):
    assert hasattr(owner(owner_name), name), (
        f"keras {keras.__version__} / jax {jax.__version__} has no `{owner_name}.{name}`, "
        "which keras_fastgrad/_compat.py uses. Fix: add a version branch for it there."
    )


def test_jit_cache_size_counts_compilations():
    function = jax.jit(lambda v: v * 2)
    function(jax.numpy.ones(2))
    function(jax.numpy.ones(3))  # a new shape: compiled again
    assert compat.jit_cache_size(function) == 2
