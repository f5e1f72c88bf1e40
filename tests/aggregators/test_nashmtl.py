"""Nash-MTL (`aggregators/_nashmtl.py`): the bargaining condition `G a = 1/a`."""

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import least_squares

from keras_fastgrad import aggregators

P_SMALL = 12


def _jac_scaled(num_tasks, seed, conflict=0.0, size=P_SMALL):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, size))
    J[1:] -= conflict * J[0]
    return J * rng.uniform(0.5, 3.0, size=(num_tasks, 1))


def _gram(J, dtype=tf.float64):
    return tf.constant(J @ J.T, dtype)


def nash_np(G):
    """Solves G_n a = 1/a (G_n = G / ||G||_F), a > 0, with scipy."""
    Gn = G / np.linalg.norm(G)
    res = least_squares(
        lambda a: Gn @ a - 1 / a,
        np.ones(len(G)),
        bounds=(1e-12, np.inf),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
    )
    return res.x


def _rel(w, ref):
    return np.max(np.abs(np.asarray(w, np.float64) - ref)) / np.max(np.abs(ref))


@pytest.mark.parametrize("num_tasks", [2, 3, 4, 6])
def test_nashmtl_solves_the_bargaining_condition(num_tasks):
    J = _jac_scaled(num_tasks, seed=70 + num_tasks, conflict=0.3, size=20)
    G = J @ J.T
    w = aggregators.NashMTL(reg_eps=0.0).weights(_gram(J)).numpy()
    Gn = G / np.linalg.norm(G)
    assert (w > 0).all()
    np.testing.assert_allclose(Gn @ w, 1 / w, rtol=1e-9)
    np.testing.assert_allclose(w, nash_np(G), rtol=1e-6)
    w32 = aggregators.get("nashmtl").weights(_gram(J, tf.float32)).numpy()
    np.testing.assert_allclose(w32, w, rtol=1e-3)


def test_nashmtl_zero_gradient_task_gets_zero_weight():
    J = _jac_scaled(3, seed=8, conflict=0.3)
    J[2] = 0.0
    w = aggregators.NashMTL(reg_eps=0.0).weights(_gram(J)).numpy()
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
        assert _rel(aggregators.NashMTL().weights(big).numpy(), ref) <= 1e-4
