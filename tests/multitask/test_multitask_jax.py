"""On JAX, `multitask` (parameter space): `Sum` against a plain
`keras.Model` on the summed losses, other merges against `jax.grad` of each
task on a plain model and a numpy merge, the reaching-task split (a head's
variables keep their task's plain gradient), the aggregator's state and
seed generator threaded through the state tuple, the task telemetry keys
against the TensorFlow step's (a TensorFlow process)."""

import json

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import ops

import keras_fastgrad as kf
from keras_fastgrad.aggregators import Aggregator
from tests.helpers import ROOT, run_on_tensorflow

LOSSES = {"a": "mse", "b": "mse"}
LOSS_WEIGHTS = {"a": 1.0, "b": 0.5}


def two_heads(cls=keras.Model, trunk="dense", regularizer=None, **options):
    """A trunk and two heads; head `b` has two layers (its own variables);
    `regularizer`: an L2 factor on the dense trunk's kernel."""
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
        l2 = None if regularizer is None else keras.regularizers.L2(regularizer)
        h = keras.layers.Dense(6, activation="tanh", name="trunk", kernel_regularizer=l2)(inputs)
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


@keras.saving.register_keras_serializable(package="test_jax_multitask")
class SumWithMemory(Aggregator):
    """`Sum`, with a state: the running sum of the tasks' squared gradient
    norms (the Gram matrix's diagonal) over the merges it was committed."""

    name = "sum_with_memory"

    def __init__(self):
        self.seen = None

    def build(self, num_tasks):
        if self.seen is None:
            self.seen = keras.Variable(np.zeros(num_tasks, "float32"), trainable=False)

    @property
    def state_variables(self):
        return [] if self.seen is None else [self.seen]

    def _weights(self, gram):
        return ops.ones((gram.shape[0],), gram.dtype)

    def weights_and_state(self, gram):
        return self.weights(gram), [self.seen.value + ops.diagonal(gram)]


@keras.saving.register_keras_serializable(package="test_jax_multitask")
class RandomWeights(Aggregator):
    """Weights drawn from a seed generator at each call."""

    name = "random_weights"

    def __init__(self, seed=3):
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def _weights(self, gram):
        return keras.random.uniform((gram.shape[0],), seed=self.seed_generator, dtype=gram.dtype)

    def get_config(self):
        return {"seed": self.seed}


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
    [
        ("embedding", {}),
        ("dense", {"accumulation_steps": 2}),
        ("conv", {"multitask_space": "features", "accumulation_steps": 2}),
        ("dense", {"micro_batches": 3}),
        ("conv", {"micro_batches": 3, "accumulation_steps": 2}),
    ],
    ids=["embedding", "accumulation", "features_space", "micro_batches", "micro_accumulation"],
)
def test_sum_is_keras_model_on_the_summed_losses(trunk, options):
    # (micro_batches=3: batches of 8 rows in slices of 3, 3 and 2.)
    x, y = data(trunk)
    model = compiled(two_heads(kf.FastGradModel, trunk, multitask="sum", **options), lr=0.1)
    steps = options.get("accumulation_steps", 1)
    big = steps * (len(x) // 4)  # acc 2 of 8 rows = batches of 16
    model.fit(x, y, batch_size=len(x) // 4, epochs=2, shuffle=False, verbose=0)
    plain = compiled(two_heads(keras.Model, trunk), lr=0.1)
    plain.fit(x, y, batch_size=big, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert model.telemetry_counters()["updates"] == 8.0 / steps


def test_micro_batches_merge_the_batchs_task_gradients_once():
    # The slices' task gradients summed are the batch's: MGDA's min-norm
    # point (closed form for two tasks) is the un-split step's, the trunk's
    # L2 gradient added after the merge. (Merging each slice would give
    # other weights: the merge is not linear. PCGrad and the per-slice
    # contrast: tests/multitask/test_multitask_models.py, tests/step/test_slicing.py.)
    x, y = data(rows=14)
    w = np.linspace(0.5, 2.0, 14).astype("float32")
    runs = []
    for options in ({}, {"micro_batches": 3}):  # batches of 7: slices of 3, 2 and 2 rows
        model = two_heads(
            kf.FastGradModel, multitask=TwoTaskMGDA(), telemetry=True, regularizer=0.05, **options
        )
        history = compiled(model, lr=0.1).fit(
            x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0
        )
        runs.append((model.get_weights(), history.history))
    (whole, h_whole), (sliced, h_sliced) = runs
    assert h_whole["task_conflicts"][0] == 1.0  # a conflict to resolve
    for got, want in zip(sliced, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for key in ("loss", "task_grad_norm/a", "task_grad_norm/b", "task_cosine/a/b"):
        np.testing.assert_allclose(h_sliced[key], h_whole[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_sum_under_loss_scaling_is_keras_model(micro_batches):
    x, y = data()
    y["b"][3, 0] = np.inf  # batch 0: dropped, the scale halved (as Keras' own)
    model = two_heads(
        kf.FastGradModel, multitask="sum", telemetry=True, micro_batches=micro_batches
    )
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss=LOSSES,
        loss_weights=LOSS_WEIGHTS,
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = two_heads()
    plain.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss=LOSSES,
        loss_weights=LOSS_WEIGHTS,
    )
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert history.history["loss_scale"] == [2.0**14]
    assert history.history["nonfinite_count"] == [1.0]


@pytest.mark.parametrize(
    "aggregator, trunk",
    [
        (FixedWeights([2.0, 0.25]), "dense"),
        (TwoTaskMGDA(), "conv"),
        (kf.aggregators.MGDA(), "dense"),
    ],
    ids=["fixed_weights", "closed_form_mgda_conv", "mgda"],
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


def _batches(x, y, size):
    return [
        (x[i : i + size], {k: v[i : i + size] for k, v in y.items()})
        for i in range(0, len(x), size)
    ]


def test_state_moves_only_on_finite_merges_and_nonfinite_task_dropped():
    x, y = data()
    y["b"][9, 0] = np.nan  # task b of batch 1 (of 4 of 8 rows)
    model = compiled(two_heads(kf.FastGradModel, multitask=SumWithMemory(), telemetry=True), lr=0.0)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert history.history["nonfinite_count"] == [1.0]
    assert history.history["updates"] == [3.0]
    plain = two_heads()
    expected = np.zeros(2)
    for i, (xb, yb) in enumerate(_batches(x, y, 8)):
        if i == 1:
            continue  # dropped: the state does not move
        grads = per_task_gradients(plain, xb, yb)
        shared = [k for k, v in enumerate(plain.trainable_variables) if v.path.startswith("trunk/")]
        expected += [sum(np.sum(grads[t][k] ** 2) for k in shared) for t in "ab"]
    np.testing.assert_allclose(model.multitask.seen.numpy(), expected, rtol=1e-5)


def test_nonfinite_task_batch_dropped_as_keras_model_without_it():
    x, y = data()
    y["b"][9, 0] = np.nan
    model = compiled(two_heads(kf.FastGradModel, multitask="sum"), lr=0.1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = compiled(two_heads(), lr=0.1)
    for i, (xb, yb) in enumerate(_batches(x, y, 8)):
        if i != 1:
            plain.train_on_batch(xb, yb)
    for got, want in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("make", [RandomWeights, kf.aggregators.PCGrad], ids=["random", "pcgrad"])
def test_seed_generator_moves_every_step_under_jit(make):
    aggregator = make(seed=3)
    start = aggregator.seed_generator.state.numpy()
    model = compiled(two_heads(kf.FastGradModel, multitask=aggregator), lr=0.01)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 4 steps, jitted
    fresh = keras.random.SeedGenerator(3)
    seeds = [fresh.state.numpy()]
    for _ in range(4):
        fresh.next()
        seeds.append(fresh.state.numpy())
    np.testing.assert_array_equal(start, seeds[0])
    np.testing.assert_array_equal(aggregator.seed_generator.state.numpy(), seeds[4])
    assert len({tuple(s.tolist()) for s in seeds}) == 5  # a new draw at every step


_TF_SCRIPT = """
import json, sys
import keras, numpy as np
sys.path.insert(0, {helpers!r})
import keras_fastgrad as kf
from tests.multitask.test_multitask_jax import FixedWeights, compiled, data, two_heads
x, y = data("embedding")
weights = list(np.load({weights!r}).values())
y["b"][20, 0] = np.nan
out = []
for options in {configs!r}:
    keras.backend.clear_session(free_memory=False)
    model = compiled(two_heads(kf.FastGradModel, "embedding", multitask=FixedWeights([2.0, 0.25]),
                               telemetry=True, **options), lr=0.05)
    model.set_weights(weights)  # the JAX side's initial weights
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    out.append({{"logs": {{k: [float(v) for v in vs] for k, vs in history.history.items()}},
                "weights": [w.tolist() for w in model.get_weights()]}})
print("RESULT" + json.dumps(out))
"""
_CONFIGS = [
    {},
    {"accumulation_steps": 3},
    {"multitask_space": "features"},
    {"micro_batches": 3},
]


@pytest.mark.needs_tensorflow(reason="the reference is a TensorFlow process")
def test_same_weights_and_logs_as_the_tensorflow_step(tmp_path):
    helpers = ROOT  # the repo root: `tests` imports as a package
    weights = str(tmp_path / "weights.npz")
    np.savez(weights, *two_heads(keras.Model, "embedding").get_weights())
    script = _TF_SCRIPT.format(helpers=helpers, configs=_CONFIGS, weights=weights)
    tf_runs = json.loads(run_on_tensorflow(script, timeout=240).split("RESULT", 1)[1])
    x, y = data("embedding")
    y["b"][20, 0] = np.nan  # batch 2 of each epoch: dropped on both
    for options, tf_run in zip(_CONFIGS, tf_runs, strict=True):
        keras.backend.clear_session(free_memory=False)
        model = compiled(
            two_heads(
                kf.FastGradModel,
                "embedding",
                multitask=FixedWeights([2.0, 0.25]),
                telemetry=True,
                **options,
            ),
            lr=0.05,
        )
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert sorted(history.history) == sorted(tf_run["logs"]), options
        assert any(k.startswith("task_cosine/") for k in history.history)
        for key, values in tf_run["logs"].items():
            if key in ("a_loss", "b_loss") and "micro_batches" in options:
                # Keras' per-output loss metrics, updated once per slice: TF's
                # slices (in a loop, batch size unknown) count alike, JAX's
                # by their rows (3, 3, 2). The dropped micro-batch is left
                # out on both (compared in the other configurations).
                continue
            np.testing.assert_allclose(
                history.history[key], values, rtol=1e-4, atol=1e-6, err_msg=f"{key} {options}"
            )
        for got, want in zip(model.get_weights(), tf_run["weights"], strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
        assert history.history["nonfinite_count"][-1] == 2.0


def test_gradvac_targets_moved_saved_and_loaded(tmp_path):
    x, y = data()
    plain = two_heads()
    grads = per_task_gradients(plain, x, y)
    shared = [k for k, v in enumerate(plain.trainable_variables) if v.path.startswith("trunk/")]
    g_a = np.concatenate([grads["a"][k].ravel() for k in shared])
    g_b = np.concatenate([grads["b"][k].ravel() for k in shared])
    cosine = g_a @ g_b / np.linalg.norm(g_a) / np.linalg.norm(g_b)
    model = compiled(two_heads(kf.FastGradModel, multitask=kf.aggregators.GradVac(beta=0.5)))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # one step from targets 0
    targets = model.multitask.state_variables[0].numpy()
    # Each pair's target moved from 0 by beta times the pair's cosine.
    np.testing.assert_allclose(targets, [[0.0, 0.5 * cosine], [0.5 * cosine, 0.0]], atol=1e-6)
    path = str(tmp_path / "gradvac.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded.fit(x[:8], {k: v[:8] for k, v in y.items()}, epochs=1, verbose=0)  # builds, trains
    assert loaded.multitask.state_variables[0].shape == (2, 2)
    fresh = keras.saving.load_model(path)
    fresh.multitask.build(2)  # the loaded targets, before any step
    np.testing.assert_allclose(fresh.multitask.state_variables[0].numpy(), targets)


def test_reaching_inputs_through_calls_loops_and_cuts():
    from keras_fastgrad.backend.jax.reaching import reaching_inputs

    @jax.jit
    def head(h, w):  # a sub-program (`jit`): walked inside
        return jnp.sum(h * w), jnp.sum(jax.lax.stop_gradient(w) * 0.0 + h)

    def f(trunk, w_a, w_b, w_c):
        h = jax.nn.relu(trunk)  # (a custom_jvp call)
        a, only_h = head(h, w_a)  # w_a cut by stop_gradient in the 2nd output

        def step(carry, _):  # a loop: one equation, all its inputs
            return carry * w_b, None

        loop, _ = jax.lax.scan(step, h, None, length=2)
        mask = (w_c > 0).astype("float32")  # a comparison: no gradient
        return a, only_h, jnp.sum(loop), jnp.sum(mask * h)

    args = [jnp.ones(3)] * 4
    closed = jax.make_jaxpr(f)(*args)
    assert reaching_inputs(closed, 4) == [{0, 1}, {0}, {0, 2}, {0}]
