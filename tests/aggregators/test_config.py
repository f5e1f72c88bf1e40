"""ConFIG (`aggregators/_config.py`) against the official equations: equal cosines.

Backend-neutral: runs under TensorFlow and JAX."""

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    P_SMALL,
    config_np,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    scaled_jacobian,
)


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_config_matches_official_and_has_equal_cosines(num_tasks):
    J = scaled_jacobian(num_tasks, seed=50 + num_tasks, conflict=0.6)
    merged = np.asarray(aggregators.ConFIG().weights(gram_of(J))) @ J
    np.testing.assert_allclose(merged, config_np(J), rtol=1e-8, atol=1e-10)
    cosines = J @ merged / (np.linalg.norm(J, axis=1) * np.linalg.norm(merged))
    np.testing.assert_allclose(cosines, cosines[0], rtol=1e-8)
    assert cosines[0] > 0
    unit = merged / np.linalg.norm(merged)  # the magnitude rule
    np.testing.assert_allclose(np.linalg.norm(merged), np.sum(J @ unit), rtol=1e-10)


def test_config_zero_gradient_task_is_ignored():
    J = scaled_jacobian(3, seed=5, conflict=0.5)
    J[1] = 0.0
    w = np.asarray(aggregators.ConFIG().weights(gram_of(J)))
    assert np.isfinite(w).all() and w[1] == 0.0
    np.testing.assert_allclose(w @ J, config_np(J[[0, 2]]), rtol=1e-8)


def test_config_keeps_small_real_directions_of_a_float64_gram():
    # Two tasks 1e-3 apart: the unit Gram's smallest eigenvalue is ~1e-7 of
    # the largest, a real direction in float64 that the official pinv keeps.
    rng = np.random.default_rng(13)
    J = rng.normal(size=(3, P_SMALL))
    J[1] = J[0] + 1e-3 * rng.normal(size=P_SMALL)
    merged = np.asarray(aggregators.ConFIG().weights(gram_of(J))) @ J
    np.testing.assert_allclose(merged, config_np(J), rtol=1e-5, atol=1e-8)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")
def test_config_under_jax_jit_matches_eager_and_official():
    import jax

    J = scaled_jacobian(4, seed=54, conflict=0.6)
    with jax.enable_x64(False):  # the JAX step's default 32-bit types
        gram = gram_of(J, "float32")
        jitted = np.asarray(jax.jit(aggregators.ConFIG().weights)(gram))
        eager = np.asarray(aggregators.ConFIG().weights(gram))
    assert jitted.dtype == np.float32
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    np.testing.assert_allclose(jitted @ J, config_np(J), rtol=1e-3, atol=1e-5)
