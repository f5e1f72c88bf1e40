"""Nash-MTL (`aggregators/_nashmtl.py`): the bargaining condition `G a = 1/a`."""

import numpy as np
import pytest
import tensorflow as tf
from aggregator_references import gram_of, nash_np, rel_error, scaled_jacobian

from keras_fastgrad import aggregators


@pytest.mark.parametrize("num_tasks", [2, 3, 4, 6])
def test_nashmtl_solves_the_bargaining_condition(num_tasks):
    J = scaled_jacobian(num_tasks, seed=70 + num_tasks, conflict=0.3, size=20)
    G = J @ J.T
    w = aggregators.NashMTL(reg_eps=0.0).weights(gram_of(J)).numpy()
    Gn = G / np.linalg.norm(G)
    assert (w > 0).all()
    np.testing.assert_allclose(Gn @ w, 1 / w, rtol=1e-9)
    np.testing.assert_allclose(w, nash_np(G), rtol=1e-6)
    w32 = aggregators.get("nashmtl").weights(gram_of(J, tf.float32)).numpy()
    np.testing.assert_allclose(w32, w, rtol=1e-3)


def test_nashmtl_zero_gradient_task_gets_zero_weight():
    J = scaled_jacobian(3, seed=8, conflict=0.3)
    J[2] = 0.0
    w = aggregators.NashMTL(reg_eps=0.0).weights(gram_of(J)).numpy()
    assert w[2] == 0.0 and np.isfinite(w).all()
    G = J @ J.T
    Gn = G / np.linalg.norm(G)  # the others bargain among themselves
    np.testing.assert_allclose((Gn @ w)[:2], 1 / w[:2], rtol=1e-9)


def test_nashmtl_without_ridge_on_singular_grams_is_finite():
    # Old: InvalidArgumentError (float32, opposite gradients).
    g = np.array([1.0, 2.0, -0.5])
    for J in (np.stack([g, -g]), np.stack([g, g, -g]), np.zeros((2, 3))):
        for dtype in (tf.float32, tf.float64):
            w = aggregators.NashMTL(reg_eps=0.0).weights(tf.constant(J @ J.T, dtype))
            assert np.isfinite(w.numpy()).all()


def test_nashmtl_float32_gram_near_the_top_of_its_range():
    # Old: weights 0 (||G||_F overflowed to inf).
    rng = np.random.default_rng(7)
    J = rng.normal(size=(4, 10))
    G = J @ J.T
    ref = aggregators.NashMTL().weights(tf.constant(G)).numpy()
    for scale in (1e20, 1e30, 1e-30):
        big = tf.constant(G / np.abs(G).max() * scale, tf.float32)
        assert rel_error(aggregators.NashMTL().weights(big).numpy(), ref) <= 1e-4
