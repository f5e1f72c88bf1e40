"""Aligned-MTL (`aggregators/_aligned_mtl.py`) against the official ProcrustesSolver's equations.

Backend-neutral: runs under TensorFlow and JAX."""

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    aligned_np,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    merged_of,
    random_jacobian,
)


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_aligned_matches_official(num_tasks):
    J = random_jacobian(num_tasks, seed=40 + num_tasks, conflict=0.5)
    J *= np.arange(1, num_tasks + 1)[:, None]
    agg = aggregators.AlignedMTL()
    merged = merged_of(agg.weights(gram_of(J)), J)
    expected, B_ref, lam_min = aligned_np(J)
    np.testing.assert_allclose(merged, expected, rtol=1e-6, atol=1e-9)
    # Balanced: the aligned gradients J^T B are orthogonal with equal norms
    # sqrt(lam_min), so the merged direction has equal components on each.
    B = np.asarray(agg.balance_matrix(gram_of(J)))
    np.testing.assert_allclose(B, B_ref, rtol=1e-6, atol=1e-9)
    aligned = J.T @ B
    eye = np.eye(num_tasks)
    np.testing.assert_allclose(aligned.T @ aligned, lam_min * eye, atol=1e-6 * lam_min)
    np.testing.assert_allclose(aligned.T @ merged, lam_min * eye.sum(0), rtol=1e-6)


def test_aligned_rank_deficient_matches_official():
    J = random_jacobian(3, seed=4)
    J[2] = J[0] + J[1]
    merged = merged_of(aggregators.AlignedMTL().weights(gram_of(J)), J)
    np.testing.assert_allclose(merged, aligned_np(J)[0], rtol=1e-5, atol=1e-8)


def test_aligned_fit_drops_a_nan_sample_and_keeps_weights_finite():
    keras.utils.set_random_seed(3)
    import keras_fastgrad

    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    outputs = [keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(hidden)]
    model = keras_fastgrad.FastGradModel(inputs, outputs, multitask="aligned")
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = [rng.normal(size=(16, 1)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")]
    x[5, 1] = np.nan  # batch 1 of 4
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.telemetry_counters()["nonfinite_count"] >= 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(
        model.evaluate(np.delete(x, 5, 0), [t[np.arange(16) != 5] for t in y], verbose=0)
    ).all()
    assert len(history.history["loss"]) == 1


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")
def test_aligned_under_jax_jit_matches_eager_and_official():
    import jax

    J = random_jacobian(3, seed=43, conflict=0.5) * np.arange(1, 4)[:, None]
    agg = aggregators.AlignedMTL(task_weights=[1.0, 2.0, 0.5])
    with jax.enable_x64(False):  # the JAX step's default 32-bit types
        gram = gram_of(J, "float32")
        jitted = np.asarray(jax.jit(agg.weights)(gram))
        eager = np.asarray(agg.weights(gram))
        nan = np.asarray(jax.jit(agg.weights)(np.full((3, 3), np.nan, np.float32)))
    assert jitted.dtype == np.float32 and np.isnan(nan).all()
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    B = aligned_np(J)[1]  # the official balance matrix; w = B omega
    np.testing.assert_allclose(jitted, B @ [1.0, 2.0, 0.5], rtol=1e-3)
