"""On JAX, `multitask` (parameter space): `Sum` against a plain
`keras.Model` on the summed losses, other merges against `jax.grad` of each
task on a plain model and a numpy merge, the reaching-task split (a head's
variables keep their task's plain gradient), the aggregator's state and
seed generator threaded through the state tuple, the task telemetry keys
against the TensorFlow step's (a TensorFlow process)."""


import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import ops

import keras_fastgrad as kf
from keras_fastgrad.aggregators import Aggregator

LOSSES = {"a": "mse", "b": "mse"}
LOSS_WEIGHTS = {"a": 1.0, "b": 0.5}


def two_heads(cls=keras.Model, trunk="dense", **options):
    """A trunk and two heads; head `b` has two layers (its own variables)."""
    keras.utils.set_random_seed(0)
    if trunk == "conv":
        inputs = keras.Input((5, 5, 2))
        h = keras.layers.Conv2D(3, 3, activation="tanh", name="trunk")(inputs)
        h = keras.layers.Flatten()(h)
    elif trunk == "embedding":
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(12, 4, name="trunk")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
    else:
        inputs = keras.Input((4,))
        h = keras.layers.Dense(6, activation="tanh", name="trunk")(inputs)
    a = keras.layers.Dense(2, name="a")(h)
    b = keras.layers.Dense(1, name="b")(
        keras.layers.Dense(3, activation="tanh", name="b_hidden")(h)
    )
    return cls(inputs, {"a": a, "b": b}, **options)


def data(trunk="dense", rows=32, seed=0):
    rng = np.random.default_rng(seed)
    if trunk == "conv":
        x = rng.normal(size=(rows, 5, 5, 2)).astype("float32")
    elif trunk == "embedding":
        x = rng.integers(0, 12, size=(rows, 6)).astype("int32")
    else:
        x = rng.normal(size=(rows, 4)).astype("float32")
    y = {
        "a": rng.normal(size=(rows, 2)).astype("float32"),
        "b": (3.0 * rng.normal(size=(rows, 1))).astype("float32"),
    }
    return x, y


@keras.saving.register_keras_serializable(package="test_jax_multitask")
class FixedWeights(Aggregator):
    """Task weights that do not depend on the Gram matrix."""

    name = "fixed_weights"

    def __init__(self, values):
        self.values = list(values)

    def _weights(self, gram):
        return ops.convert_to_tensor(self.values, gram.dtype)

    def get_config(self):
        return {"values": self.values}


@keras.saving.register_keras_serializable(package="test_jax_multitask")
class TwoTaskMGDA(Aggregator):
    """MGDA for two tasks in closed form: the min-norm point of the segment
    between `g_a` and `g_b`, `w = (gamma, 1 - gamma)`."""

    name = "two_task_mgda"

    def _weights(self, gram):
        denominator = gram[0, 0] + gram[1, 1] - 2.0 * gram[0, 1]
        gamma = ops.clip((gram[1, 1] - gram[0, 1]) / ops.maximum(denominator, 1e-12), 0.0, 1.0)
        return ops.stack([gamma, 1.0 - gamma])


def mgda_weights(gram):
    denominator = gram[0, 0] + gram[1, 1] - 2.0 * gram[0, 1]
    gamma = np.clip((gram[1, 1] - gram[0, 1]) / denominator, 0.0, 1.0)
    return np.array([gamma, 1.0 - gamma])


def per_task_gradients(plain, x, y):
    """`jax.grad` of each task's loss (hand-written mse times its weight)
    on a plain model: `{task: [gradient per trainable variable]}`."""
    weights = [jnp.asarray(v.numpy()) for v in plain.trainable_variables]
    non_trainable = [v.value for v in plain.non_trainable_variables]

    def task_loss(trainable, task):
        pred, _ = plain.stateless_call(trainable, non_trainable, x)
        return LOSS_WEIGHTS[task] * jnp.mean((pred[task] - y[task]) ** 2)

    return {t: [np.asarray(g) for g in jax.grad(task_loss)(weights, t)] for t in ("a", "b")}


def compiled(model, lr=1.0):
    model.compile(keras.optimizers.SGD(lr), loss=LOSSES, loss_weights=LOSS_WEIGHTS)
    return model


@pytest.mark.parametrize(
    "trunk, options",
    [("embedding", {}), ("dense", {"accumulation_steps": 2})],
    ids=["embedding", "accumulation"],
)
def test_sum_is_keras_model_on_the_summed_losses(trunk, options):
    x, y = data(trunk)
    model = compiled(two_heads(kf.FastGradModel, trunk, multitask="sum", **options), lr=0.1)
    big = 2 * (len(x) // 4) if options else len(x) // 4  # acc 2 of 8 rows = batches of 16
    model.fit(x, y, batch_size=len(x) // 4, epochs=2, shuffle=False, verbose=0)
    plain = compiled(two_heads(keras.Model, trunk), lr=0.1)
    plain.fit(x, y, batch_size=big, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert model.telemetry_counters()["updates"] == (4.0 if options else 8.0)


@pytest.mark.parametrize(
    "aggregator, trunk",
    [(FixedWeights([2.0, 0.25]), "dense"), (TwoTaskMGDA(), "conv")],
    ids=["fixed_weights", "mgda_conv"],
)
def test_merge_against_jax_grad_of_each_task(aggregator, trunk):
    x, y = data(trunk)
    plain = two_heads(keras.Model, trunk)
    grads = per_task_gradients(plain, x, y)
    paths = [v.path for v in plain.trainable_variables]
    shared = [p.startswith("trunk/") for p in paths]
    gram = np.array(
        [
            [
                sum(np.vdot(grads[s][k], grads[t][k]) for k in range(len(paths)) if shared[k])
                for t in "ab"
            ]
            for s in "ab"
        ]
    )
    w = np.array(aggregator.values) if isinstance(aggregator, FixedWeights) else mgda_weights(gram)
    assert gram[0, 1] < 0 or isinstance(aggregator, FixedWeights)  # a conflict to resolve
    model = compiled(two_heads(kf.FastGradModel, trunk, multitask=aggregator, telemetry=True))
    history = model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    for k, (path, before, after) in enumerate(
        zip(paths, plain.get_weights(), model.get_weights(), strict=True)
    ):
        if shared[k]:
            merged = w[0] * grads["a"][k] + w[1] * grads["b"][k]
        else:  # a head's own variable: its task's plain gradient, unweighted
            merged = grads["a"][k] + grads["b"][k]  # (the other task's is 0)
        np.testing.assert_allclose(before - after, merged, atol=1e-5, err_msg=path)
    logs = {k: v[-1] for k, v in history.history.items()}
    np.testing.assert_allclose(
        [logs["task_grad_norm/a"], logs["task_grad_norm/b"]], np.sqrt(np.diag(gram)), rtol=1e-4
    )
    cosine = gram[0, 1] / np.sqrt(gram[0, 0] * gram[1, 1])
    np.testing.assert_allclose(logs["task_cosine/a/b"], cosine, rtol=1e-4, atol=1e-6)
    assert logs["task_conflicts"] == float(gram[0, 1] < 0)
