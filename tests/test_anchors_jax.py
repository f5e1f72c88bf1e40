"""benchmarks/anchors_jax.py: the gated `keras.Model` that bench_jax.py
measures the default step against takes the same steps as `keras.Model`
itself (the reference) on finite batches (dense, BatchNorm, embedding;
with the optimizer's own accumulation), and leaves the weights and the
optimizer untouched on a non-finite gradient."""

import importlib.util
import os

import keras
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def anchors():
    spec = importlib.util.spec_from_file_location(
        "anchors_jax_under_test", os.path.join(ROOT, "benchmarks", "anchors_jax.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3)(h))


def batchnorm(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs))
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    return cls(inputs, keras.layers.Dense(3)(h))


def embedding(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(inputs))
    return cls(inputs, keras.layers.Dense(3)(h))


BUILDERS = {"dense": dense, "batchnorm": batchnorm, "embedding": embedding}


def batches(name, n=4):
    rng = np.random.default_rng(0)
    if name == "embedding":
        x = rng.integers(0, 50, size=(n * 8, 5)).astype("int32")
    elif name == "batchnorm":
        x = rng.normal(size=(n * 8, 6, 6, 1)).astype("float32")
    else:
        x = rng.normal(size=(n * 8, 6)).astype("float32")
    return x, rng.integers(0, 3, size=(n * 8,)).astype("int32")


def trained(cls, build, x, y, **optimizer_options):
    model = build(cls)
    model.compile(
        keras.optimizers.Adam(1e-2, **optimizer_options),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, history.history["loss"][0]


@pytest.mark.parametrize(
    "name, accumulation", [("dense", None), ("dense", 2), ("batchnorm", None), ("embedding", 2)]
)
def test_gated_anchor_steps_as_keras_on_finite_batches(anchors, name, accumulation):
    x, y = batches(name)
    options = {"gradient_accumulation_steps": accumulation} if accumulation else {}
    reference, reference_loss = trained(keras.Model, BUILDERS[name], x, y, **options)
    gated, gated_loss = trained(anchors.JaxGatedModel, BUILDERS[name], x, y, **options)
    assert gated_loss == pytest.approx(reference_loss, rel=1e-6)
    for a, b in zip(gated.weights, reference.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(gated.optimizer.iterations) == int(reference.optimizer.iterations)


def test_gated_anchor_leaves_weights_and_optimizer_on_a_nan_batch(anchors):
    x, y = batches("dense", n=1)
    model = dense(anchors.JaxGatedModel)
    model.compile(
        keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # builds the optimizer
    before = [np.asarray(v) for v in model.weights + model.optimizer.variables]
    x[3, 2] = np.nan
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = [np.asarray(v) for v in model.weights + model.optimizer.variables]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    ungated = dense(lambda *a, **k: anchors.JaxGatedModel(*a, gate=False, **k))
    ungated.compile(
        keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    ungated.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isnan(np.asarray(ungated.weights[0])).any()  # Keras' own step applies it
