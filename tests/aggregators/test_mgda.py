"""MGDA (`aggregators/_mgda.py`) against the min-norm point (numpy, quadprog's stored numbers)."""

import itertools

import numpy as np
import pytest
import tensorflow as tf  # noqa: E402
from helpers import (
    mgda_np,  # noqa: E402
)

from keras_fastgrad import aggregators  # noqa: E402

P = 50


def _jac(num_tasks, seed, conflict=0.0):
    """Random `J`; `conflict > 0` pulls tasks 1.. against task 0."""
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, P))
    J[1:] -= conflict * J[0]
    return J


def _gram(J, dtype=tf.float64):
    return tf.constant(J @ J.T, dtype)


def min_norm_np(J):
    """Exact min-norm point of conv{g_t}: best affine minimiser of all faces."""
    G = J @ J.T
    best = None
    for size in range(1, len(J) + 1):
        for face in itertools.combinations(range(len(J)), size):
            x = np.linalg.lstsq(G[np.ix_(face, face)], np.ones(size), rcond=None)[0]
            if x.sum() <= 0:
                continue
            w = np.zeros(len(J))
            w[list(face)] = x / x.sum()
            if w.min() >= -1e-12 and (best is None or w @ G @ w < best @ G @ best):
                best = w
    return best


@pytest.mark.parametrize(
    "num_tasks,case",
    [(2, "plain"), (3, "plain"), (4, "plain"), (4, "face"), (4, "ill")],
)
def test_mgda_min_norm(num_tasks, case):
    J = _jac(num_tasks, seed=10 + num_tasks)
    if case == "face":  # the min-norm point has w_2 = 0
        J[2] = 4.0 * (J[0] + J[1]) + 0.1 * J[2]
    if case == "ill":  # a large gradient and a near-opposite one (cond ~ 1e3)
        J[0] *= 5.0
        J[1] = -0.8 * J[0] + 0.3 * J[1]
    ref = min_norm_np(J)
    assert case != "face" or ref[2] == 0
    w = aggregators.MGDA().weights(_gram(J)).numpy()
    assert w.min() >= -1e-12 and abs(w.sum() - 1) < 1e-9
    norm = np.linalg.norm(w @ J)
    np.testing.assert_allclose(norm, np.linalg.norm(ref @ J), rtol=1e-4)
    rng = np.random.default_rng(0)
    others = np.concatenate([np.eye(num_tasks), rng.dirichlet(np.ones(num_tasks), 200)])
    assert norm <= np.linalg.norm(others @ J, axis=1).min() * (1 + 1e-9)


@pytest.mark.parametrize("ratio", [1e4, 1e8, 1e10, 1e12])
def test_mgda_min_norm_point_when_task_norms_differ_by_orders(ratio):
    # Old: 5% too long a merged gradient at a norm ratio of 1e8.
    rng = np.random.default_rng(11)
    J = rng.normal(size=(3, 6))
    J[1:] -= 0.6 * J[0]
    J /= np.linalg.norm(J, axis=1, keepdims=True)
    J[0] *= ratio
    G = J @ J.T
    w = aggregators.MGDA().weights(tf.constant(G)).numpy()
    ref = mgda_np(G)
    np.testing.assert_allclose(np.sqrt(w @ G @ w), np.sqrt(ref @ G @ ref), rtol=1e-9)
    np.testing.assert_allclose(w, ref, rtol=1e-7, atol=1e-15)
