"""IMTL-G (`aggregators/_imtl.py`) against the paper's closed form and its pseudo-inverse form.

Backend-neutral: runs under TensorFlow and JAX."""

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    P,
    compiled,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    imtl_np,
    imtl_pinv_np,
    merged_of,
    random_jacobian,
    rel_error,
)


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_imtl_matches_paper(num_tasks):
    J = random_jacobian(num_tasks, seed=30 + num_tasks, conflict=0.4)
    J *= np.arange(1, num_tasks + 1)[:, None]  # unequal norms
    merged = merged_of(aggregators.IMTL().weights(gram_of(J)), J)
    expected, U = imtl_np(J)
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-8)
    projections = U @ merged  # <g, u_t> equal for every task
    np.testing.assert_allclose(projections, projections[0], rtol=1e-6)


def test_imtl_singular_is_finite():
    J = random_jacobian(3, seed=2)
    J[2] = J[1]
    w = np.asarray(aggregators.IMTL().weights(gram_of(J, "float32")))
    assert np.all(np.isfinite(w))
    merged = merged_of(w, J)
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    np.testing.assert_allclose(U @ merged, (U @ merged)[0], rtol=1e-3)


@pytest.mark.parametrize("num_tasks, rank", [(2, 2), (3, 3), (4, 4), (5, 5), (4, 2)])
def test_imtl_matches_numpy_pinv_formula_on_random_grams(num_tasks, rank):
    rng = np.random.default_rng(70 + num_tasks + rank)
    J = rng.normal(size=(rank, P))
    J = rng.normal(size=(num_tasks, rank)) @ J  # rank-deficient when rank < T
    J *= rng.uniform(0.1, 10.0, size=(num_tasks, 1))
    w = np.asarray(aggregators.IMTL().weights(gram_of(J)))
    np.testing.assert_allclose(w, imtl_pinv_np(J @ J.T), rtol=1e-6, atol=1e-9)
    if rank == num_tasks:  # else no direction has equal projections
        U = J / np.linalg.norm(J, axis=1, keepdims=True)
        np.testing.assert_allclose(U @ (w @ J), (U @ (w @ J))[0], rtol=1e-6)


@pytest.mark.parametrize("zero_task", [0, 1, 2])
def test_imtl_zero_gradient_task_does_not_zero_the_update(zero_task):
    J = random_jacobian(3, seed=80, conflict=0.4)
    J[zero_task] = 0.0
    w = np.asarray(aggregators.IMTL().weights(gram_of(J)))
    others = [t for t in range(3) if t != zero_task]
    # By hand: the zero task gets nothing; the two others get the paper's
    # closed form on their own (equal projections, weights summing to 1).
    expected_merged, U = imtl_np(J[others])
    assert w[zero_task] == 0.0
    np.testing.assert_allclose(w @ J, expected_merged, rtol=1e-6, atol=1e-9)
    assert np.linalg.norm(w @ J) > 0.1
    np.testing.assert_allclose(w, imtl_pinv_np(J @ J.T), rtol=1e-6, atol=1e-12)


def test_imtl_keeps_small_real_singular_values_of_a_float64_gram():
    # Tasks 0 and 1 differ by 1e-3: the Gram's smallest eigenvalue is ~2e-7
    # of the largest, real in float64 (eps 2e-16) but below a float32-sized
    # cut-off (T * 10 * 1.2e-7), which would answer ~5% off.
    rng = np.random.default_rng(91)
    J = rng.normal(size=(3, P))
    J[1] = J[0] + 1e-3 * rng.normal(size=P)
    G = J @ J.T
    eigenvalues = np.linalg.eigvalsh(G)
    assert 1e-8 < eigenvalues[0] / eigenvalues[-1] < 1e-6
    w = np.asarray(aggregators.IMTL().weights(G))
    np.testing.assert_allclose(w, imtl_pinv_np(G), rtol=1e-7)
    expected_merged, U = imtl_np(J)  # the paper's closed form, plain inverse
    np.testing.assert_allclose(w @ J, expected_merged, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(U @ (w @ J), (U @ (w @ J))[0], rtol=1e-7)


def test_imtl_under_xla_does_not_depend_on_the_scale():
    # Old: 1e-6 scale 2.4 off, 1e-4 1e-5 off under XLA; float32 1e30: NaN.
    # (TensorFlow's XLA; `jax.jit` under JAX.)
    rng = np.random.default_rng(3)
    J = rng.normal(size=(5, 10))
    J[1:] -= 0.4 * J[0]
    G = J @ J.T
    ref = np.asarray(aggregators.IMTL().weights(G))
    xla = compiled(aggregators.IMTL().weights)
    for scale in (1e-6, 1e-4, 1.0, 1e4):
        assert rel_error(xla(G * scale), ref) <= 1e-9
        assert rel_error(xla((G * scale).astype(np.float32)), ref) <= 1e-5
    top = (G / np.abs(G).max() * 1e30).astype(np.float32)
    assert rel_error(xla(top), ref) <= 1e-5


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")
def test_imtl_under_jax_jit_matches_eager_and_numpy():
    import jax

    J = random_jacobian(4, seed=34, conflict=0.4) * np.arange(1, 5)[:, None]
    with jax.enable_x64(False):  # the JAX step's default 32-bit types
        gram = gram_of(J, "float32")
        jitted = np.asarray(jax.jit(aggregators.IMTL().weights)(gram))
        eager = np.asarray(aggregators.IMTL().weights(gram))
    assert jitted.dtype == np.float32
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    np.testing.assert_allclose(jitted, imtl_pinv_np(J @ J.T), rtol=1e-4)
