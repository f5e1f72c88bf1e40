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


def test_the_tensorflow_bridge_is_asked_for_by_name_on_jax():
    # `keras_fastgrad._compat` imports it on TensorFlow only; on JAX a name
    # of it is looked up when asked for (TensorFlow itself never imported:
    # tests/test_without_tensorflow_jax.py).
    from keras_fastgrad._compat import tensorflow as tensorflow_bridge

    assert not set(compat._TENSORFLOW_NAMES) & set(vars(compat))
    assert compat.in_xla_context is tensorflow_bridge.in_xla_context
    assert compat.PRIVATE_NAMES == (
        compat.KERAS_PRIVATE_NAMES + tensorflow_bridge.TENSORFLOW_PRIVATE_NAMES
    )


def test_the_batchnorm_recorder_is_reached_through_compat():
    from keras_fastgrad.step import batchnorm_recording

    assert compat.batchnorm_recording is batchnorm_recording.batchnorm_recording
