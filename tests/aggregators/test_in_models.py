"""Aggregators inside `FastGradModel`'s step: the merged update against
Keras layers, tapes and the numpy references; save and load."""

import itertools

import keras
import numpy as np
import pytest
from multitask_helpers import (
    assert_step,
    build,
    compiled,
    expected_gradient,
    flat,
    make_data,
    reference_model,
    shared_mask,
    task_gradients,
    weights_of,
)
from scipy.optimize import least_squares

NEW = ("upgrad", "dualproj", "config", "gradvac", "nashmtl")


def dual_cone_qp_np(G, u):
    """`argmin v^T G v s.t. v >= u` by brute force over the active sets:
    the KKT point (v >= u, (Gv)_free = 0, (Gv)_active >= 0) of least cost."""
    T, best = len(u), None
    tol = 1e-9 * max(1.0, np.abs(G).max())
    for size in range(T + 1):
        for active in itertools.combinations(range(T), size):
            free = [i for i in range(T) if i not in active]
            v = np.array(u, np.float64)
            if free:
                rhs = -G[np.ix_(free, list(active))] @ v[list(active)]
                v[free] = np.linalg.lstsq(G[np.ix_(free, free)], rhs, rcond=None)[0]
            grad = G @ v
            if (
                (v >= u - tol).all()
                and (grad[list(active)] >= -tol).all()
                and (np.abs(grad[free]) <= tol * max(1.0, np.abs(v).max())).all()
            ):
                if best is None or v @ G @ v < best @ G @ best - tol:
                    best = v
    return best


def torchjd_gram_np(G, norm_eps=1e-4, reg_eps=1e-4):
    trace = np.trace(G)
    G = np.zeros_like(G) if trace < norm_eps else G / trace
    return G + reg_eps * np.eye(len(G))


def upgrad_np(G, **eps):
    """torchjd's UPGradWeighting: sum_i v(e_i / T)."""
    Gn, T = torchjd_gram_np(G, **eps), len(G)
    return sum(dual_cone_qp_np(Gn, np.eye(T)[i] / T) for i in range(T))


def dualproj_np(G, **eps):
    T = len(G)
    return dual_cone_qp_np(torchjd_gram_np(G, **eps), np.full(T, 1.0 / T))


def config_np(J):
    """Official `ConFIG_update` (conflictfree): pinv of the unit gradients
    times ones, made unit, scaled by the sum of projections."""
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    best = np.linalg.pinv(U) @ np.ones(len(J))
    unit = best / np.linalg.norm(best)
    return np.sum(J @ unit) * unit


def gradvac_np(J, targets, beta):
    """GradVac Algorithm 1 on vectors, other tasks in increasing order."""
    targets = np.array(targets, np.float64)
    total = np.zeros(J.shape[1])
    for i in range(len(J)):
        g = J[i].copy()
        for j in [k for k in range(len(J)) if k != i]:
            phi = g @ J[j] / (np.linalg.norm(g) * np.linalg.norm(J[j]))
            t = targets[i, j]
            if phi < t:
                g = g + J[j] * np.linalg.norm(g) * (
                    t * np.sqrt(1 - phi**2) - phi * np.sqrt(1 - t**2)
                ) / (np.linalg.norm(J[j]) * np.sqrt(1 - t**2))
            targets[i, j] = (1 - beta) * t + beta * phi
        total += g
    return total, targets


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


def _weights_np(name, J):
    G = J @ J.T
    if name == "upgrad":
        return upgrad_np(G)
    if name == "dualproj":
        return dualproj_np(G)
    if name == "nashmtl":
        return nash_np(G)
    return None


@pytest.mark.parametrize("name", NEW)
def test_model_step_matches_the_reference(name):
    model = compiled(build(multitask=name))
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y)
    J = np.stack([flat(grads[t], shared_mask(model)) for t in "ab"])
    assert J[0] @ J[1] < 0
    if name == "config":
        merged = config_np(J)
    elif name == "gradvac":
        merged = gradvac_np(J, np.zeros((2, 2)), 0.01)[0]
    else:
        merged = _weights_np(name, J) @ J
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected_gradient(model, grads, merged), rtol=1e-4)


@pytest.mark.parametrize("name", NEW)
def test_model_trains_and_round_trips(name, tmp_path):
    model = compiled(build(multitask=name))
    x, y = make_data(n=32)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.multitask) is type(model.multitask)
    assert loaded.multitask.get_config() == model.multitask.get_config()
    if name == "gradvac":  # the EMA targets come back
        saved = model.multitask.state_variables[0].numpy()
        assert np.abs(saved).max() > 0
        loaded.multitask.build(2)
        np.testing.assert_array_equal(loaded.multitask.state_variables[0].numpy(), saved)
    model.train_on_batch(x[:8], {t: v[:8] for t, v in y.items()})
    loaded.train_on_batch(x[:8], {t: v[:8] for t, v in y.items()})
    for a, b in zip(weights_of(model), weights_of(loaded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.multitask.state_variables, loaded.multitask.state_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
