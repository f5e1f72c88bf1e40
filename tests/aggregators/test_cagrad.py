"""CAGrad (`aggregators/_cagrad.py`) against the official code's equations."""

import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    cagrad_np,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    merged_of,
    random_jacobian,
)


@pytest.mark.parametrize(
    "num_tasks,c,rescale", [(2, 0.5, 1), (3, 0.5, 1), (4, 0.4, 0), (4, 0.8, 2)]
)
def test_cagrad_matches_official(num_tasks, c, rescale):
    J = random_jacobian(num_tasks, seed=20 + num_tasks, conflict=0.5)
    w = np.asarray(aggregators.CAGrad(c=c, rescale=rescale).weights(gram_of(J)))
    expected, objfn, x_ref = cagrad_np(J, c, rescale)
    np.testing.assert_allclose(merged_of(w, J), expected, rtol=1e-3, atol=1e-4)
    # The in-graph simplex solution is at least as good as SLSQP's.
    lam_w = w * {0: 1.0, 1: 1 + c**2, 2: 1 + c}[rescale] - 1.0 / num_tasks
    x_ours = lam_w / lam_w.sum()
    assert objfn(x_ours) <= objfn(x_ref) + 1e-9 * abs(objfn(x_ref))


def test_cagrad_c0_is_mean():
    J = random_jacobian(3, seed=5, conflict=0.5)
    w = np.asarray(aggregators.CAGrad(c=0.0).weights(gram_of(J)))
    np.testing.assert_allclose(w, np.full(3, 1 / 3), atol=1e-7)


def test_cagrad_float32_gram_with_entries_from_1e_minus_18_to_1e24():
    # Old: NaN weights.
    rng = np.random.default_rng(3)
    J = rng.normal(size=(5, 5))
    J[1:] -= rng.uniform(0, 1) * J[0]
    J *= 10.0 ** rng.uniform(-10, 18, size=(5, 1))
    G = (J @ J.T).astype(np.float32)
    assert np.isfinite(G).all()
    w = np.asarray(aggregators.CAGrad().weights(G))
    assert np.isfinite(w).all()
    # Where the official constants are negligible, the scale drops out.
    w64 = np.asarray(aggregators.CAGrad().weights(np.eye(3) * 1e30))
    w1 = np.asarray(aggregators.CAGrad().weights(np.eye(3)))
    np.testing.assert_allclose(w64, w1, rtol=1e-7)
