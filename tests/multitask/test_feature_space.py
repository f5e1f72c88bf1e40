"""FastGradModel(multitask_space="features") against references by hand.

The references are the forward pass and its gradients written out in numpy
(float64) on copies of the weights (`z = tanh(x K + b)`, `pred_t = z K_t +
b_t`, the task loss `w_t * mean((pred_t - y_t)^2)`, differentiated by hand:
`dZ_t` and each task's parameter gradients), the Gram matrix of the
flattened `dZ_t`, and the task weights from numpy versions of the papers'
rules (PCGrad: Algorithm 1 on the vectors, the weights recovered by least
squares; MGDA: the exact min-norm point by enumerating the active sets).
The expected update is `sum_t w_t dL_t/dtheta` on the trunk and the plain
`sum_t dL_t/dphi` on the heads; the model trains with SGD. Runs on both
backends.
"""

import itertools

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import aggregators
from keras_fastgrad.multitask.feature_space import find_features
from tests import multitask_helpers
from tests.aggregator_references import mgda_np, pcgrad_np
from tests.multitask_helpers import LR, compiled, conflicting


# ------------------------------------------------------------------ models
def build(cls=keras_fastgrad.FastGradModel, **options):
    """`multitask_helpers.build` (Input (3,) -> Dense(4, tanh) "trunk" -> one
    Dense(1) head per task) with `multitask_space="features"`."""
    if cls is not keras.Model:
        options.setdefault("multitask_space", "features")
    return multitask_helpers.build(cls, **options)


def make_data(n=8, num_tasks=2, seed=0):
    """`multitask_helpers.make_data` with noise on the targets."""
    return multitask_helpers.make_data(n=n, num_tasks=num_tasks, seed=seed, noise=0.3)


def weights_of(model):
    """{"layer/variable": value}: a subclass's paths lose the model's name."""
    return {
        "/".join(v.path.split("/")[-2:]): v.numpy().astype("float64")
        for v in model.trainable_variables
    }


# -------------------------------------------------------------- reference
def by_hand(model, x, y, loss_weights=None):
    """(dZ [T, B*4], {task: {path: gradient}}) from the forward pass and its
    gradients written out in numpy (float64)."""
    w = {
        "/".join(v.path.split("/")[-2:]): v.numpy().astype("float64")
        for v in model.trainable_variables
    }
    x = x.astype("float64")
    z = np.tanh(x @ w["trunk/kernel"] + w["trunk/bias"])
    dz, grads = [], {}
    for t in y:
        scale = 1.0 if loss_weights is None else loss_weights[t]
        residual = z @ w[f"{t}/kernel"] + w[f"{t}/bias"] - y[t]
        d_pred = 2.0 * scale * residual / residual.size  # d mean((pred - y)^2)
        d_z = d_pred @ w[f"{t}/kernel"].T
        d_pre = d_z * (1.0 - z**2)  # tanh'
        grads[t] = {p: np.zeros_like(v) for p, v in w.items()}
        grads[t].update(
            {
                "trunk/kernel": x.T @ d_pre,
                "trunk/bias": d_pre.sum(axis=0),
                f"{t}/kernel": z.T @ d_pred,
                f"{t}/bias": d_pred.sum(axis=0),
            }
        )
        dz.append(d_z.ravel())
    return np.stack(dz), grads


def pcgrad_weights_np(dz, orders):
    """Algorithm 1 on the dZ vectors; weights w with w^T dZ = merged."""
    merged = pcgrad_np(dz, orders)
    w, *_ = np.linalg.lstsq(dz.T, merged, rcond=None)
    np.testing.assert_allclose(w @ dz, merged, atol=1e-9)
    return w


def expected_update(grads, w):
    """Trunk: sum_t w_t g_t; heads: the plain sum (their own task's)."""
    tasks = list(grads)
    out = {}
    for p in grads[tasks[0]]:
        weights = w if p.startswith("trunk") else np.ones(len(tasks))
        out[p] = sum(wt * grads[t][p] for wt, t in zip(weights, tasks))
    return out


def assert_step(before, after, gradient, rtol=1e-5, atol=1e-6):
    for p, g in gradient.items():
        np.testing.assert_allclose(after[p], before[p] - LR * g, rtol=rtol, atol=atol, err_msg=p)


# ------------------------------------------------------------- the update
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("method", ["pcgrad", "mgda"])
def test_two_tasks_update_is_weighted_sum_with_weights_from_z_gram(method, jit_compile):
    loss_weights = {"a": 1.0, "b": 0.4}
    model = compiled(
        conflicting(build(multitask=method, telemetry=True)), loss_weights, jit_compile=jit_compile
    )
    x, y = make_data()
    dz, grads = by_hand(model, x, y, loss_weights)
    gram = dz @ dz.T
    assert gram[0, 1] < 0, "the test needs conflicting tasks"
    w = pcgrad_weights_np(dz, [[1], [0]]) if method == "pcgrad" else mgda_np(gram)
    assert not np.allclose(w, 1.0), "weights of 1 would not test the merge"
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert_step(before, weights_of(model), expected_update(grads, w))
    # The telemetry is the representation-space Gram matrix's.
    np.testing.assert_allclose(logs["task_grad_norm/a"], np.sqrt(gram[0, 0]), rtol=1e-5)
    np.testing.assert_allclose(
        logs["task_cosine/a/b"], gram[0, 1] / np.sqrt(gram[0, 0] * gram[1, 1]), rtol=1e-4
    )
    assert logs["task_conflicts"] == 1.0


def test_three_tasks_mgda():
    model = compiled(build(num_tasks=3, multitask="mgda"))
    x, y = make_data(num_tasks=3)
    for _ in range(3):
        dz, grads = by_hand(model, x, y)
        w = mgda_np(dz @ dz.T)
        before = weights_of(model)
        model.train_on_batch(x, y)
        assert_step(before, weights_of(model), expected_update(grads, w), atol=2e-6)


def test_three_tasks_pcgrad_is_algorithm1_for_some_order():
    model = compiled(build(num_tasks=3, multitask=aggregators.PCGrad(seed=3)))
    x, y = make_data(num_tasks=3)
    others = [[j for j in range(3) if j != i] for i in range(3)]
    candidates = list(itertools.product(*[list(itertools.permutations(o)) for o in others]))
    for _ in range(3):
        dz, grads = by_hand(model, x, y)
        before = weights_of(model)
        model.train_on_batch(x, y)
        after = weights_of(model)
        matched = False
        for orders in candidates:
            expected = expected_update(grads, pcgrad_weights_np(dz, orders))
            matched |= all(
                np.allclose(after[p], before[p] - LR * g, rtol=1e-5, atol=1e-6)
                for p, g in expected.items()
            )
        assert matched, "the step matches no visiting order of Algorithm 1"


def test_sum_equals_keras_model_on_the_summed_loss():
    x, y = make_data(n=12)
    model = compiled(build(multitask="sum"))
    ref = compiled(build(keras.Model))
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-6, atol=1e-6)


def test_regularization_gradient_is_added():
    l2 = 0.05
    model = compiled(build(multitask="mgda", regularizer=keras.regularizers.L2(l2)))
    x, y = make_data()
    dz, grads = by_hand(model, x, y)
    expected = expected_update(grads, mgda_np(dz @ dz.T))
    before = weights_of(model)
    expected["trunk/kernel"] = expected["trunk/kernel"] + 2 * l2 * before["trunk/kernel"]
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected)


def test_a_variable_both_upstream_of_z_and_read_by_a_head():
    # `tied` runs twice: under the trunk (upstream of Z) and directly in
    # head b's path. Its update is the merged part through Z plus its plain
    # direct part; the reference (numpy, by hand) follows each path.
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    tied = keras.layers.Dense(3, use_bias=False, name="tied")
    z = keras.layers.Dense(4, activation="tanh", name="trunk")(tied(inputs))
    b_in = keras.layers.Concatenate()([z, tied(inputs)])
    outputs = {"a": keras.layers.Dense(1, name="a")(z), "b": keras.layers.Dense(1, name="b")(b_in)}
    model = compiled(
        keras_fastgrad.FastGradModel(inputs, outputs, multitask="mgda", multitask_space="features")
    )
    assert find_features(model) == ("trunk", 0)
    x, y = make_data()
    w = {v.path: v.numpy().astype("float64") for v in model.trainable_variables}
    x64 = x.astype("float64")
    h = x64 @ w["tied/kernel"]
    z = np.tanh(h @ w["trunk/kernel"] + w["trunk/bias"])
    dz, grads = [], {}
    for t in "ab":  # by hand: d mean((pred - y)^2), back through each path
        feed = z if t == "a" else np.concatenate([z, h], axis=1)
        residual = feed @ w[f"{t}/kernel"] + w[f"{t}/bias"] - y[t]
        d_pred = 2.0 * residual / residual.size
        d_feed = d_pred @ w[f"{t}/kernel"].T
        d_z = d_feed[:, :4]
        d_pre = d_z * (1.0 - z**2)  # tanh'
        dz.append(d_z.ravel())
        grads[t] = {
            "trunk/kernel": h.T @ d_pre,
            "trunk/bias": d_pre.sum(axis=0),
            "tied/kernel": x64.T @ (d_pre @ w["trunk/kernel"].T),  # through Z
            f"{t}/kernel": feed.T @ d_pred,
            f"{t}/bias": d_pred.sum(axis=0),
        }
        if t == "b":  # the head's direct read of `tied`'s output
            grads[t]["tied_direct"] = x64.T @ d_feed[:, 4:]
    dz = np.stack(dz)
    weights = mgda_np(dz @ dz.T)
    assert abs(weights[0] - weights[1]) > 0.05
    expected = {
        p: sum(wt * grads[t][p] for wt, t in zip(weights, "ab"))
        for p in ("tied/kernel", "trunk/kernel", "trunk/bias")
    }
    expected["tied/kernel"] = expected["tied/kernel"] + grads["b"]["tied_direct"]
    expected.update(
        {p: grads[p.split("/")[0]][p] for p in ("a/kernel", "a/bias", "b/kernel", "b/bias")}
    )
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected)


# ------------------------------------------------------------- finding Z
def test_z_is_the_deepest_tensor_every_output_depends_on():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(5, name="t1")(inputs)
    z = keras.layers.Dense(4, name="t2")(h)
    skip = keras.layers.Concatenate(name="skip")([z, h])  # head a also reads t1
    outputs = [
        keras.layers.Dense(1, name="a")(keras.layers.Dense(2, name="a_hidden")(skip)),
        keras.layers.Dense(1, name="b")(z),
    ]
    model = keras_fastgrad.FastGradModel(
        inputs, outputs, multitask="sum", multitask_space="features"
    )
    assert find_features(model) == ("t2", 0)


def test_outputs_sharing_no_layer_are_refused():
    inputs = keras.Input((3,))
    outputs = {t: keras.layers.Dense(1, name=t)(inputs) for t in "ab"}
    model = compiled(
        keras_fastgrad.FastGradModel(
            inputs, outputs, multitask="pcgrad", multitask_space="features"
        )
    )
    x, y = make_data()
    with pytest.raises(
        ValueError,
        match=r"`multitask_space=\"features\"`.*share no layer"
        r".*Received: multitask_features=None\. Fix: ",
    ):
        model.train_on_batch(x, y)


def test_an_unknown_layer_name_is_refused():
    model = compiled(build(multitask="pcgrad", multitask_features="nope"))
    x, y = make_data()
    with pytest.raises(
        ValueError,
        match=r"`multitask_features` must name a layer of the "
        r"model.*Received: multitask_features='nope'.*'trunk'",
    ):
        model.train_on_batch(x, y)


def test_a_layer_off_some_task_path_is_refused():
    model = compiled(build(multitask="pcgrad", multitask_features="a"))
    x, y = make_data()
    with pytest.raises(ValueError, match=r"on every task's path.*task 'b' does not read"):
        model.train_on_batch(x, y)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(multitask_space="feature"), ValueError, r"`multitask_space` must be one of"),
        (dict(multitask_space=None), TypeError, r"`multitask_space` must be one of"),
        (dict(multitask=None), ValueError, r"needs a multi-task method.*multitask=None"),
        (dict(multitask_features=3), TypeError, r"`multitask_features` must be None or a layer"),
        (
            dict(multitask_space="parameters", multitask_features="trunk"),
            ValueError,
            r"Fix: pass `multitask_space=\"features\"`",
        ),
        (
            dict(micro_batches=2),
            ValueError,
            r"`micro_batches` and `multitask_space=.features.` cannot",
        ),
    ],
)
def test_options_are_validated(options, error, match):
    options = {"multitask": "pcgrad", **options}
    with pytest.raises(error, match=match):
        build(**options)


class TwoHeads(keras_fastgrad.FastGradModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.trunk = keras.layers.Dense(4, activation="tanh", name="trunk")
        self.a = keras.layers.Dense(1, name="a")
        self.b = keras.layers.Dense(1, name="b")

    def call(self, x):
        z = self.trunk(x)
        return {"a": self.a(z), "b": self.b(z)}


def test_subclassed_model_with_a_named_layer():
    functional = build(multitask="pcgrad")
    model = TwoHeads(multitask="pcgrad", multitask_space="features", multitask_features="trunk")
    model(np.zeros((1, 3), "float32"))
    for layer in ("trunk", "a", "b"):
        getattr(model, layer).set_weights(functional.get_layer(layer).get_weights())
    compiled(model)
    x, y = make_data()
    dz, grads = by_hand(functional, x, y)
    expected = expected_update(grads, pcgrad_weights_np(dz, [[1], [0]]))
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected)
    assert "call" not in vars(model.trunk)  # the capture is undone


class Trunk(keras.layers.Layer):
    """A custom layer without `build` (its Dense is built by `call`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, activation="tanh")

    def call(self, x):
        return self.dense(x)


def test_unbuilt_subclass_with_a_custom_trunk_layer():
    class Model(keras_fastgrad.FastGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.trunk = Trunk(name="trunk")
            self.a = keras.layers.Dense(1, name="a")
            self.b = keras.layers.Dense(1, name="b")

        def call(self, x):
            z = self.trunk(x)
            return {"a": self.a(z), "b": self.b(z)}

    model = compiled(
        Model(multitask="mgda", multitask_space="features", multitask_features="trunk")
    )
    x, y = make_data()
    model.train_on_batch(x, y)
    assert all(np.isfinite(w).all() for w in weights_of(model).values())


def test_fastgrad_gives_a_plain_model_the_features_space_step():
    x, y = make_data()
    model = compiled(build(multitask="mgda"))
    plain = keras_fastgrad.fastgrad(
        compiled(build(keras.Model)), multitask="mgda", multitask_space="features"
    )
    assert plain.get_config()["multitask_space"] == "features"
    for m in (model, plain):
        m.train_on_batch(x, y)
    for a, b in zip(weights_of(model).values(), weights_of(plain).values()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------- the rest of the chain
@pytest.mark.parametrize("method", ["sum", "mean"])
def test_accumulation_equals_the_big_batch(method):
    x, y = make_data(n=16)
    big = compiled(build(multitask=method))
    acc = compiled(build(multitask=method, accumulation_steps=2))
    big.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    acc.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(acc.optimizer.iterations.numpy()) == 2
    for a, b in zip(weights_of(acc).values(), weights_of(big).values()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_clipping_applies_to_the_merged_gradient():
    model = compiled(build(multitask="mgda", clip_norm=0.05))
    x, y = make_data()
    dz, grads = by_hand(model, x, y)
    g = expected_update(grads, mgda_np(dz @ dz.T))
    norm = np.sqrt(sum(np.sum(gi**2) for gi in g.values()))
    assert norm > 0.05
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), {p: gi * 0.05 / norm for p, gi in g.items()})


def test_mixed_float16_unscales_once():
    # A loss scale of 64 unscaled twice or never would be off 64x.
    x, y = make_data()
    float32 = build(multitask="mgda")
    dz, grads = by_hand(float32, x, y)
    expected = expected_update(grads, mgda_np(dz @ dz.T))
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = build(multitask="mgda", telemetry=True)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=64.0),
        loss={"a": "mse", "b": "mse"},
    )
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 0.0 and logs["loss_scale"] == 64.0
    assert_step(before, weights_of(model), expected, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(logs["task_grad_norm/a"], np.linalg.norm(dz[0]), rtol=2e-2)


def test_steps_per_execution_3_equals_1():
    x, y = make_data(n=12)
    results = []
    for spe in (1, 3):
        model = compiled(build(multitask="mgda"), steps_per_execution=spe)
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        results.append(weights_of(model))
    for p in results[0]:
        np.testing.assert_allclose(results[0][p], results[1][p], rtol=1e-6, atol=1e-7)


def test_nonfinite_micro_batch_is_dropped():
    model = compiled(build(multitask="pcgrad", telemetry=True))
    x, y = make_data()
    x[0, 0] = np.nan
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 1.0
    for p, w in weights_of(model).items():
        np.testing.assert_array_equal(w, before[p])


def test_save_load_keeps_the_options(tmp_path):
    model = compiled(build(multitask="mgda", multitask_features="trunk"))
    x, y = make_data()
    model.train_on_batch(x, y)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.multitask_space == "features"
    assert loaded.multitask_features == "trunk"
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    for a, b in zip(weights_of(model).values(), weights_of(loaded).values()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ tf.distribute
# Under MirroredStrategy (the global Gram matrix): mirrored_multitask.py
# with this module's model, run with every MirroredStrategy case in one
# process by end_to_end/test_distributed.py.


def test_a_features_layer_that_runs_twice_is_refused():
    # A shared layer named as `multitask_features` has no single output the
    # tasks read: refused by name, with the fix (both backends).
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(3, activation="tanh", name="trunk")
    z1 = trunk(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(z1),
        "b": keras.layers.Dense(1, name="b")(trunk(z1)),
    }
    model = compiled(
        keras_fastgrad.FastGradModel(
            inputs,
            outputs,
            multitask="mgda",
            multitask_space="features",
            multitask_features="trunk",
        )
    )
    x = np.ones((4, 3), "float32")
    y = {"a": np.ones((4, 1), "float32"), "b": np.ones((4, 1), "float32")}
    with pytest.raises(ValueError, match="multitask_features='trunk', which ran more than once"):
        model.train_on_batch(x, y)
