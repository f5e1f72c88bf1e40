"""FastGradModel(multitask=...) against references written independently.

The references compute each task's gradient with its own plain
`tf.GradientTape` on a plain `keras.Model` holding the same weights, the task
loss written out by hand (`w_t * mean((pred - y)^2)`), and merge the
flattened shared gradients with numpy implementations of the papers'
formulas (PCGrad: Yu et al. 2020, Algorithm 1). The model under test is
trained with SGD, so one step moves the weights by `-lr * gradient`.
"""

import itertools

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import aggregators
from keras_fastgrad.step.task_losses import regularization_loss, task_losses
from tests.aggregator_references import pcgrad_np
from tests.multitask_helpers import (  # noqa: F401 (mirrored_multitask.py reads them here)
    LR,
    TASKS,
    assert_step,
    build,
    compiled,
    conflicting,
    expected_gradient,
    flat,
    make_data,
    reference_model,
    shared_mask,
    task_gradients,
    unflat,
    weights_of,
)


# ------------------------------------------------------------------ losses
def test_task_losses_and_regularization_sum_to_compute_loss():
    model = build(keras.Model, regularizer=keras.regularizers.L2(0.05))
    compiled(model, loss_weights={"a": 0.3, "b": 2.0})
    x, y = make_data()
    sw = np.linspace(0.5, 1.5, len(x)).astype("float32")
    y_pred = model(x)
    tasks = task_losses(model, y, y_pred, sw)
    total = model.compute_loss(x, y, y_pred, sw)
    assert len(tasks) == 2
    got = float(tasks[0] + tasks[1] + regularization_loss(model))
    np.testing.assert_allclose(got, float(total), rtol=1e-6)
    # Each task loss is its weight times the (sample-weighted) output loss.
    for t, w, loss in zip("ab", (0.3, 2.0), tasks):
        err = np.square(keras.ops.convert_to_numpy(y_pred[t]) - y[t])[:, 0]
        np.testing.assert_allclose(float(loss), w * np.mean(err * sw), rtol=1e-5)


# ------------------------------------------------------------------ PCGrad
@pytest.mark.parametrize("jit_compile", [False, True])
def test_pcgrad_two_conflicting_tasks_match_algorithm1(jit_compile):
    loss_weights = {"a": 1.0, "b": 0.4}
    model = compiled(
        conflicting(build(multitask="pcgrad", telemetry=True)),
        loss_weights=loss_weights,
        jit_compile=jit_compile,
    )
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y, loss_weights)
    mask = shared_mask(model)
    J = np.stack([flat(grads[t], mask) for t in "ab"])
    assert J[0] @ J[1] < 0, "the test needs conflicting tasks"
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    merged = pcgrad_np(J, [[1], [0]])
    assert_step(before, weights_of(model), expected_gradient(model, grads, merged))
    # The telemetry is the Gram matrix's: norms, cosine, one conflicting pair.
    norms = np.linalg.norm(J, axis=1)
    np.testing.assert_allclose(logs["task_grad_norm/a"], norms[0], rtol=1e-5)
    np.testing.assert_allclose(logs["task_grad_norm/b"], norms[1], rtol=1e-5)
    np.testing.assert_allclose(logs["task_cosine/a/b"], J[0] @ J[1] / norms.prod(), rtol=1e-4)
    assert logs["task_conflicts"] == 1.0


def test_no_conflict_equals_keras_model_with_summed_losses():
    # Both tasks fit the same target from identical heads: every step's task
    # gradients agree (cosine 1), so PCGrad projects nothing.
    x, y = make_data(signs=(1.0, 1.0))
    model = compiled(build(multitask="pcgrad", telemetry=True))
    ref = compiled(build(keras.Model))
    head = model.get_layer("a").get_weights()
    for m in (model, ref):
        m.get_layer("b").set_weights(head)
    history = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert history.history["task_conflicts"] == [0.0, 0.0, 0.0]
    for a, b in zip(weights_of(model), weights_of(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["task_cosine/a/b"][-1], 1.0, rtol=1e-5)


def test_three_tasks_each_step_is_algorithm1_for_some_order_and_orders_vary():
    model = compiled(build(num_tasks=3, multitask=aggregators.PCGrad(seed=3)))
    x, y = make_data(num_tasks=3)
    mask = shared_mask(model)
    others = [[j for j in range(3) if j != i] for i in range(3)]
    candidates = list(itertools.product(*[list(itertools.permutations(o)) for o in others]))
    matched_per_step = []
    for _ in range(8):
        grads = task_gradients(reference_model(model), x, y)
        J = np.stack([flat(grads[t], mask) for t in "abc"])
        results = [pcgrad_np(J, orders) for orders in candidates]
        before = weights_of(model)
        model.train_on_batch(x, y)
        step = (flat(before, mask) - flat(weights_of(model), mask)) / LR
        matched = {k for k, r in enumerate(results) if np.allclose(step, r, rtol=1e-4, atol=1e-6)}
        assert matched, "the step matches no visiting order of Algorithm 1"
        distinct = {tuple(np.round(r, 5)) for r in results}
        if len(distinct) > 1:  # orders matter at this step
            matched_per_step.append(matched)
    assert len(matched_per_step) >= 4
    # The orders vary: two steps whose results fit disjoint sets of orders.
    assert any(not (a & b) for a, b in itertools.combinations(matched_per_step, 2))


def test_tug_of_war_pcgrad_lowers_both_losses_where_the_sum_raises_one():
    # Yu et al. (2020), Fig. 1 style: shared theta in R^2, fixed heads, so
    # that g_1 = (-10, 0) and g_2 = (1, -1) at every theta.
    def loss_is_output(y_true, y_pred):
        return y_pred[:, 0]

    def tug(multitask):
        inputs = keras.Input((1,))
        theta = keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros", name="theta")(
            inputs
        )
        heads = {}
        for name, kernel in (("t1", [[-10.0], [0.0]]), ("t2", [[1.0], [-1.0]])):
            head = keras.layers.Dense(
                1,
                use_bias=False,
                trainable=False,
                name=name,
                kernel_initializer=keras.initializers.Constant(kernel),
            )
            heads[name] = head(theta)
        model = keras_fastgrad.FastGradModel(inputs, heads, multitask=multitask)
        model.compile(
            optimizer=keras.optimizers.SGD(LR), loss={"t1": loss_is_output, "t2": loss_is_output}
        )
        return model

    x = np.ones((4, 1), "float32")
    y = {"t1": np.zeros((4, 1), "float32"), "t2": np.zeros((4, 1), "float32")}

    def losses(model):
        out = model.predict(x, verbose=0)
        return float(out["t1"][0, 0]), float(out["t2"][0, 0])

    for multitask, expected_theta in ((None, [0.9, 0.1]), ("pcgrad", [0.5, 0.6])):
        model = tug(multitask)
        l1, l2 = losses(model)
        model.train_on_batch(x, y)
        np.testing.assert_allclose(
            model.get_layer("theta").kernel.numpy()[0], expected_theta, rtol=1e-6
        )
        n1, n2 = losses(model)
        assert n1 < l1
        if multitask is None:
            assert n2 > l2  # the sum: task 2 gets worse
        else:
            assert n2 < l2  # PCGrad: both improve


@pytest.mark.parametrize("method", ["mean", "sum"])
def test_linear_methods_match_numpy(method):
    model = compiled(build(multitask=method))
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y)
    mask = shared_mask(model)
    J = np.stack([flat(grads[t], mask) for t in "ab"])
    merged = J.mean(axis=0) if method == "mean" else J.sum(axis=0)
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected_gradient(model, grads, merged))


# ------------------------------------------------------- the rest of the chain
def test_regularization_gradient_is_added_after_merging():
    l2 = 0.05
    model = compiled(conflicting(build(multitask="pcgrad", regularizer=keras.regularizers.L2(l2))))
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y)
    mask = shared_mask(model)
    J = np.stack([flat(grads[t], mask) for t in "ab"])
    assert J[0] @ J[1] < 0
    before = weights_of(model)
    model.train_on_batch(x, y)
    expected = expected_gradient(model, grads, pcgrad_np(J, [[1], [0]]))
    kernel = [k for k, v in enumerate(model.trainable_variables) if v.path == "trunk/kernel"][0]
    expected[kernel] = expected[kernel] + 2 * l2 * before[kernel]
    assert_step(before, weights_of(model), expected)


def test_accumulation_merges_each_micro_batch_then_accumulates():
    # 6 samples in batches of 4 and 2: one update with the sample-weighted
    # mean of the two micro-batches' merged gradients.
    model = compiled(conflicting(build(multitask="pcgrad", accumulation_steps=2, telemetry=True)))
    x, y = make_data(n=6)
    ref = reference_model(model)
    mask = shared_mask(model)
    total = None
    for batch in (slice(0, 4), slice(4, 6)):
        yb = {t: v[batch] for t, v in y.items()}
        grads = task_gradients(ref, x[batch], yb)
        J = np.stack([flat(grads[t], mask) for t in "ab"])
        assert J[0] @ J[1] < 0
        g = expected_gradient(model, grads, pcgrad_np(J, [[1], [0]]))
        n = len(x[batch])
        total = [n * gi for gi in g] if total is None else [a + n * gi for a, gi in zip(total, g)]
    before = weights_of(model)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_step(before, weights_of(model), [t / 6.0 for t in total])
    # The telemetry is the last micro-batch's, of the true (mean) gradients.
    np.testing.assert_allclose(
        history.history["task_grad_norm/b"][-1], np.linalg.norm(J[1]), rtol=1e-5
    )


def test_clipping_applies_to_the_merged_gradient():
    model = compiled(build(multitask="pcgrad", clip_norm=0.05))
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y)
    mask = shared_mask(model)
    J = np.stack([flat(grads[t], mask) for t in "ab"])
    g = expected_gradient(model, grads, pcgrad_np(J, [[1], [0]]))
    norm = np.sqrt(sum(np.sum(gi**2) for gi in g))
    assert norm > 0.05
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), [gi * 0.05 / norm for gi in g])


def test_steps_per_execution_3_equals_1():
    x, y = make_data(n=12)
    results = []
    for spe in (1, 3):
        model = compiled(build(multitask="pcgrad", telemetry=True), steps_per_execution=spe)
        history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        results.append((weights_of(model), history.history))
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for key in ("task_grad_norm/a", "task_grad_norm/b", "task_cosine/a/b"):
        np.testing.assert_allclose(results[0][1][key], results[1][1][key], rtol=1e-5)


def test_mixed_float16_unscales_once_before_merging():
    # Reference in float32; then the same weights under mixed_float16 with a
    # loss scale of 64: an unscaling done twice or never would be off 64x.
    x, y = make_data()
    expected_model = compiled(build(multitask="pcgrad"))
    grads = task_gradients(reference_model(expected_model), x, y)
    mask = shared_mask(expected_model)
    J = np.stack([flat(grads[t], mask) for t in "ab"])
    expected = expected_gradient(expected_model, grads, pcgrad_np(J, [[1], [0]]))
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = build(multitask="pcgrad", telemetry=True)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=64.0),
        loss={"a": "mse", "b": "mse"},
    )
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 0.0 and logs["loss_scale"] == 64.0
    assert_step(before, weights_of(model), expected, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(logs["task_grad_norm/a"], np.linalg.norm(J[0]), rtol=2e-2)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    for w in weights_of(model):
        assert np.all(np.isfinite(w))
    assert np.isfinite(history.history["loss"]).all()


def test_nonfinite_micro_batch_is_dropped():
    model = compiled(build(multitask="pcgrad", telemetry=True))
    x, y = make_data()
    x[0, 0] = np.nan
    before = weights_of(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 1.0
    for a, b in zip(before, weights_of(model)):
        np.testing.assert_array_equal(a, b)


def test_save_load_round_trip_restores_the_aggregator(tmp_path):
    model = compiled(build(multitask=aggregators.MGDA(max_iter=50)))
    x, y = make_data()
    model.train_on_batch(x, y)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_fastgrad.FastGradModel)
    assert isinstance(loaded.multitask, aggregators.MGDA)
    assert loaded.multitask.max_iter == 50
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    for a, b in zip(weights_of(model), weights_of(loaded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------- errors
def test_single_output_model_is_refused_at_compile():
    inputs = keras.Input((3,))
    out = keras.layers.Dense(1, name="out")(inputs)
    model = keras_fastgrad.FastGradModel(inputs, out, multitask="pcgrad")
    with pytest.raises(
        ValueError,
        match=r"`multitask='pcgrad'`: a multi-task method needs at least two "
        r"task losses.*This model has 1 task loss \(outputs: \['out'\]",
    ):
        model.compile(optimizer="sgd", loss="mse")


def test_one_loss_on_a_two_output_model_is_refused():
    model = build(multitask="mgda")
    with pytest.raises(ValueError, match=r"`multitask='mgda'`.*This model has 1 task loss "):
        model.compile(optimizer="sgd", loss={"a": "mse", "b": None})


def test_subclassed_single_output_is_refused_at_the_first_step():
    class One(keras_fastgrad.FastGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = One(multitask="pcgrad")
    model(np.ones((2, 3), "float32"))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError, match=r"needs at least two task losses.*This model has 1 task loss"
    ):
        model.train_on_batch(np.ones((2, 3), "float32"), np.ones((2, 1), "float32"))


def test_overridden_compute_loss_is_refused():
    class Custom(keras_fastgrad.FastGradModel):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    outs = {t: keras.layers.Dense(1, name=t)(inputs) for t in "ab"}
    model = Custom(inputs, outs, multitask="pcgrad")
    with pytest.raises(ValueError, match=r"overrides `compute_loss`.*Fix:"):
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})


@pytest.mark.parametrize("value", ["pcgard", 3, {"class_name": "Nope"}])
def test_unknown_method_lists_the_valid_names(value):
    with pytest.raises(ValueError, match=r"`multitask` .*'pcgrad'.*Received: multitask="):
        build(multitask=value)


def test_task_keys_are_accepted_by_enable_telemetry():
    model = build(multitask="pcgrad")
    model.enable_telemetry(["task_conflicts", "task_grad_norm/a"])
    compiled(model)
    x, y = make_data()
    logs = model.train_on_batch(x, y, return_dict=True)
    assert {"task_conflicts", "task_grad_norm/a", "task_cosine/a/b"} <= set(logs)


# ------------------------------------------------------------ tf.distribute
def mirrored_probe(model, x, y):
    """For tests/mirrored_multitask.py: do the tasks conflict on the first
    batch (else a per-replica merge could not differ)?"""
    grads = task_gradients(reference_model(model), x[:4], {t: v[:4] for t, v in y.items()})
    J = [flat(grads[t], shared_mask(model)) for t in "ab"]
    return {"first_batch_conflicts": bool(J[0] @ J[1] < 0)}


# Under MirroredStrategy (the global task gradients merged):
# mirrored_multitask.py with this module's model, run with every
# MirroredStrategy case in one process by end_to_end/test_distributed.py.
