"""MGDA (`aggregators/_mgda.py`) against the min-norm point (numpy, quadprog's stored numbers)."""

import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    mgda_np,
    min_norm_np,
    random_jacobian,
)


@pytest.mark.parametrize(
    "num_tasks,case",
    [(2, "plain"), (3, "plain"), (4, "plain"), (4, "face"), (4, "ill")],
)
def test_mgda_min_norm(num_tasks, case):
    J = random_jacobian(num_tasks, seed=10 + num_tasks)
    if case == "face":  # the min-norm point has w_2 = 0
        J[2] = 4.0 * (J[0] + J[1]) + 0.1 * J[2]
    if case == "ill":  # a large gradient and a near-opposite one (cond ~ 1e3)
        J[0] *= 5.0
        J[1] = -0.8 * J[0] + 0.3 * J[1]
    ref = min_norm_np(J)
    assert case != "face" or ref[2] == 0
    w = np.asarray(aggregators.MGDA().weights(gram_of(J)))
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
    w = np.asarray(aggregators.MGDA().weights(G))
    ref = mgda_np(G)
    np.testing.assert_allclose(np.sqrt(w @ G @ w), np.sqrt(ref @ G @ ref), rtol=1e-9)
    np.testing.assert_allclose(w, ref, rtol=1e-7, atol=1e-15)
