"""Nash-MTL (`aggregators/_nashmtl.py`): the bargaining condition `G a = 1/a`.

Backend-neutral: runs under TensorFlow and JAX."""

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    nash_np,
    rel_error,
    scaled_jacobian,
)


@pytest.mark.parametrize("num_tasks", [2, 3, 4, 6])
def test_nashmtl_solves_the_bargaining_condition(num_tasks):
    J = scaled_jacobian(num_tasks, seed=70 + num_tasks, conflict=0.3, size=20)
    G = J @ J.T
    w = np.asarray(aggregators.NashMTL(reg_eps=0.0).weights(gram_of(J)))
    Gn = G / np.linalg.norm(G)
    assert (w > 0).all()
    np.testing.assert_allclose(Gn @ w, 1 / w, rtol=1e-9)
    np.testing.assert_allclose(w, nash_np(G), rtol=1e-6)
    w32 = np.asarray(aggregators.get("nashmtl").weights(gram_of(J, "float32")))
    np.testing.assert_allclose(w32, w, rtol=1e-3)


def test_nashmtl_zero_gradient_task_gets_zero_weight():
    J = scaled_jacobian(3, seed=8, conflict=0.3)
    J[2] = 0.0
    w = np.asarray(aggregators.NashMTL(reg_eps=0.0).weights(gram_of(J)))
    assert w[2] == 0.0 and np.isfinite(w).all()
    G = J @ J.T
    Gn = G / np.linalg.norm(G)  # the others bargain among themselves
    np.testing.assert_allclose((Gn @ w)[:2], 1 / w[:2], rtol=1e-9)


def test_nashmtl_without_ridge_on_singular_grams_is_finite():
    # Old: InvalidArgumentError (float32, opposite gradients).
    g = np.array([1.0, 2.0, -0.5])
    for J in (np.stack([g, -g]), np.stack([g, g, -g]), np.zeros((2, 3))):
        for dtype in ("float32", "float64"):
            w = aggregators.NashMTL(reg_eps=0.0).weights(gram_of(J, dtype))
            assert np.isfinite(np.asarray(w)).all()


def test_nashmtl_float32_gram_near_the_top_of_its_range():
    # Old: weights 0 (||G||_F overflowed to inf).
    rng = np.random.default_rng(7)
    J = rng.normal(size=(4, 10))
    G = J @ J.T
    ref = np.asarray(aggregators.NashMTL().weights(gram_of(J)))
    for scale in (1e20, 1e30, 1e-30):
        big = (G / np.abs(G).max() * scale).astype(np.float32)
        assert rel_error(aggregators.NashMTL().weights(big), ref) <= 1e-4


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")
def test_nashmtl_under_jax_jit_matches_eager_and_the_bargaining_solution():
    import jax

    J = scaled_jacobian(4, seed=74, conflict=0.3, size=20)
    agg = aggregators.NashMTL(reg_eps=0.0)
    with jax.enable_x64(False):  # the JAX step's default 32-bit types
        gram = gram_of(J, "float32")
        jitted = np.asarray(jax.jit(agg.weights)(gram))
        eager = np.asarray(agg.weights(gram))
    assert jitted.dtype == np.float32
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    np.testing.assert_allclose(jitted, nash_np(J @ J.T), rtol=1e-3)
