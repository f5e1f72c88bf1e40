"""Aggregators inside `FastGradModel`'s step: the merged update against
Keras layers, per-task gradients (a tape, or `jax.grad` on JAX) and the
numpy references; save and load. Runs on both backends."""

import keras
import numpy as np
import pytest

from tests.aggregator_references import NEW, config_np, dualproj_np, gradvac_np, nash_np, upgrad_np
from tests.multitask_helpers import (
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


def _weights_np(name, J):
    G = J @ J.T
    if name == "upgrad":
        return upgrad_np(G)
    if name == "dualproj":
        return dualproj_np(G)
    if name == "nashmtl":
        return nash_np(G)
    return None


def _conflicting_weights(model):
    """Weights of a fixed numpy draw (the same on every backend, whose
    initialisers draw differently) under which the tasks conflict."""
    rng = np.random.default_rng(0)
    return [rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()]


@pytest.mark.parametrize("name", NEW)
def test_model_step_matches_the_reference(name):
    model = compiled(build(multitask=name))
    model.set_weights(_conflicting_weights(model))
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
