"""In-step micro-batching equals the un-split step on the whole batch.

Reference: plain `keras.Model` trained on the same batches."""

import keras
import numpy as np
import pytest

from tests.helpers import (
    data,
    fast,
    max_weight_diff,
    mlp,
    tf,  # (TensorFlow imported at first use: not on JAX)
)


def both(options=None, optimizer=lambda: keras.optimizers.SGD(0.1), **compile_kwargs):
    ref, model = mlp(), fast(**(options or {}))
    ref.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"], **compile_kwargs)
    return ref, model


@pytest.mark.parametrize("slices", [2, 3, 4])
def test_uneven_split_equals_the_whole_batch(slices):
    # A batch of 10 in 3 slices: 4, 3, 3 (as `numpy.array_split`).
    x, y = data(n=20)
    ref, model = both({"micro_batches": slices})
    h_ref = ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h.history["mae"], h_ref.history["mae"], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_adam_and_sample_weights():
    x, y = data(n=14)
    w = np.linspace(0.2, 3.0, 14).astype("float32")
    ref, model = both({"micro_batches": 4}, optimizer=lambda: keras.optimizers.Adam(0.01))
    ref.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_xla_equals_graph_mode():
    x, y = data(n=20)
    ref, model = both({"micro_batches": 3}, jit_compile=True)
    ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5


def test_with_accumulation_and_clipping():
    # Windows of 2 batches of 6, each batch in 4 slices; vs batches of 12.
    x, y = data(n=24)
    y = y * 10.0
    ref = mlp()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.5), loss="mse")
    model = fast(micro_batches=4, accumulation_steps=2, clip_norm=0.5)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_weight_regularization_counts_once():
    def build(cls, **options):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(5, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1))(
            inputs
        )
        return cls(inputs, keras.layers.Dense(1)(h), **options)

    import keras_fastgrad

    x, y = data(n=20)
    ref, model = build(keras.Model), build(keras_fastgrad.FastGradModel, micro_batches=3)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    h_ref = ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_nan_in_one_slice_drops_the_batch():
    x, y = data(n=20)
    xs = x.copy()
    xs[13, 0] = np.nan  # second batch, its second slice
    keep = np.r_[0:10]
    ref, model = both({"micro_batches": 3, "telemetry": True})
    ref.fit(x[keep], y[keep], batch_size=10, shuffle=False, verbose=0)
    h = model.fit(xs, y, batch_size=10, shuffle=False, verbose=0)
    assert h.history["nonfinite_count"] == [1.0]
    assert max_weight_diff(ref, model) < 1e-6


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=20)
    lso = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.1), initial_scale=2.0**8
    )
    ref, model = both({"micro_batches": 3}, optimizer=lso)
    ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 2e-3  # float16 forward rounding


def test_save_load_keeps_micro_batches(tmp_path):
    model = fast(micro_batches=3)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(*data(n=6), batch_size=6, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.models.load_model(path).micro_batches == 3


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"`micro_batches` must be an integer >= 1.*Received: micro_batches=0"),
        (
            1.5,
            TypeError,
            r"`micro_batches` must be an integer >= 1.*micro_batches=1.5 of type float",
        ),
        ("2", TypeError, r"`micro_batches` must be an integer.*micro_batches='2' of type str"),
    ],
)
def test_bad_micro_batches(value, error, match):
    with pytest.raises(error, match=match):
        fast(micro_batches=value)


@pytest.mark.needs_tensorflow(reason="batches of a static shape from a tf.data pipeline")
def test_micro_batches_larger_than_the_batch():
    # Batches of 2 (a static shape) in `micro_batches=4`: one slice per row,
    # no empty or padded slice; the un-split step on batches of 2.
    x, y = data(n=4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(2, drop_remainder=True)
    ref, model = both({"micro_batches": 4})
    ref.fit(dataset, verbose=0)
    model.fit(dataset, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 2


def two_task_model(regularized, **options):
    """A trunk shared by two heads (targets of opposite signs: conflict)."""
    import keras_fastgrad

    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(
        6,
        activation="tanh",
        name="trunk",
        kernel_regularizer=keras.regularizers.L2(0.01) if regularized else None,
    )(inputs)
    heads = {t: keras.layers.Dense(1, name=t)(trunk) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(inputs, heads, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"a": "mse", "b": "mae"},
        loss_weights={"a": 1.0, "b": 0.5},
    )
    return model


@pytest.mark.parametrize("method", ["pcgrad", "mgda", "upgrad"])
@pytest.mark.parametrize("regularized", [False, True])
def test_micro_batches_with_multitask_equal_the_unsplit_merge(method, regularized):
    # Reference: the un-split multi-task step (itself checked against
    # numpy in test_merger.py) on the same batches of 7 (3 slices:
    # 3, 2, 2). The merge is nonlinear: merging per slice
    # would differ; the task gradients must be summed first.
    x, _ = data(n=14)
    rng = np.random.default_rng(3)
    y = {
        "a": rng.normal(size=(14, 1)).astype("float32"),
        "b": -3.0 + rng.normal(size=(14, 1)).astype("float32"),
    }
    w = np.linspace(0.5, 2.0, 14).astype("float32")
    ref = two_task_model(regularized, multitask=method)
    model = two_task_model(regularized, multitask=method, micro_batches=3)
    h_ref = ref.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    # Merging per slice would not match (the test can tell them apart).
    per_slice = two_task_model(regularized, multitask=method)
    per_slice.fit(x, y, sample_weight=w, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, per_slice) > 1e-4


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 22, 24])
@pytest.mark.parametrize("slices", [2, 3, 4])
def test_slice_sizes_are_numpy_array_split_without_empty_slices(n, slices):
    from keras_fastgrad.step.splitting import slice_sizes

    expected = [len(p) for p in np.array_split(np.arange(n), slices) if len(p)] or [0]
    assert slice_sizes(n, slices) == expected


# The rules of `keras_fastgrad.step.slicing` / `splitting` (backend-neutral:
# these run under every backend), against numpy or values worked by hand.


@pytest.mark.parametrize("n", [0, 1, 5, 7, 22])
@pytest.mark.parametrize("slices", [1, 3, 4])
def test_each_slice_takes_the_rows_numpy_array_split_gives_it(n, slices):
    from keras import ops

    from keras_fastgrad.step import splitting

    expected = [p.tolist() for p in np.array_split(np.arange(n), slices) if len(p)] or [[]]
    static = splitting.plan(n, slices)
    traced = splitting.plan(ops.convert_to_tensor(n), slices, ops.minimum, ops.maximum)
    cast = lambda c: ops.cast(c, "int32")  # noqa: E731
    for split, indicator, minimum in ((static, int, min), (traced, cast, ops.minimum)):
        assert int(split.count) == len(expected)
        taken = []
        for i in range(len(expected)):
            start = int(split.start(i, minimum))
            taken.append(list(range(start, start + int(split.rows(i, indicator)))))
        assert taken == expected
    # The static groups: every slice once, in order, one size per group.
    grouped = []
    for group in splitting.static_groups(n, slices):
        for i in range(group.first, group.end):
            assert static.rows(i) == group.size
            grouped.append(i)
    assert grouped == list(range(len(expected)))


def test_the_totals_give_the_whole_batch_loss_and_gradient():
    from keras import ops

    from keras_fastgrad.step import slicing

    # Two slices, mean reduction: normalisers 3 and 2, mean losses 1 and 4,
    # mean gradients [1, 2] and [6, -1] (by hand: the batch's loss is
    # (3*1 + 2*4) / 5 = 2.2, its gradient (3*[1, 2] + 2*[6, -1]) / 5).
    zero = ops.zeros((), "float32")
    totals = slicing.SliceTotals([[ops.zeros((2,), "float32")]], zero, zero)
    for d, loss, g in ((3.0, 1.0, [1.0, 2.0]), (2.0, 4.0, [6.0, -1.0])):
        d = ops.convert_to_tensor(d)
        sums = [[totals.sums[0][0] + ops.convert_to_tensor(g) * d]]
        totals = slicing.add_slice(totals, sums, [ops.convert_to_tensor(loss)], d)
    one = ops.convert_to_tensor(1.0)
    normaliser = slicing.batch_normaliser(totals, True, one)
    np.testing.assert_allclose(float(normaliser), 5.0)
    np.testing.assert_allclose(float(slicing.batch_loss(totals, True)), 2.2, rtol=1e-6)
    (grad,) = slicing.batch_gradient(totals.sums[0], normaliser, True, accumulating=False)
    np.testing.assert_allclose(ops.convert_to_numpy(grad), [3.0, 0.8], rtol=1e-6)
    # Accumulating: the window divides, the sums stay; `"sum"`: never divided.
    (kept,) = slicing.batch_gradient(totals.sums[0], normaliser, True, accumulating=True)
    np.testing.assert_allclose(ops.convert_to_numpy(kept), [15.0, 4.0], rtol=1e-6)
    assert float(slicing.batch_normaliser(totals, False, one)) == 1.0
    np.testing.assert_allclose(float(slicing.batch_loss(totals, False)), 11.0, rtol=1e-6)
    # An empty batch (no weighted element): loss 0, not nan.
    empty = slicing.SliceTotals([], zero, zero)
    assert float(slicing.batch_loss(empty, True)) == 0.0


def test_a_non_finite_slice_makes_the_batch_non_finite():
    from keras import ops

    from keras_fastgrad.step import slicing

    zero = ops.zeros((), "float32")
    totals = slicing.SliceTotals([[zero]], zero, zero)
    for g, loss in ((1.0, 1.0), (np.nan, 2.0), (1.0, 1.0)):
        one = ops.convert_to_tensor(1.0)
        sums = [[totals.sums[0][0] + ops.convert_to_tensor(g)]]
        totals = slicing.add_slice(totals, sums, [ops.convert_to_tensor(loss)], one)
    (grad,) = slicing.batch_gradient(totals.sums[0], totals.normaliser, True, False)
    assert np.isnan(float(grad))  # (the step's finite verdict drops the batch)
    assert np.isfinite(float(slicing.batch_loss(totals, True)))  # (the loss was finite)


def test_sum_reduction_rules_by_hand():
    import collections

    from keras import ops

    from keras_fastgrad.step import slicing

    # 3 slices of shares 1: two penalties too many; under a mean, exact.
    zero = ops.zeros((), "float32")
    totals = slicing.SliceTotals([], zero, ops.convert_to_tensor(3.0))
    assert float(slicing.surplus_regularization(totals, mean=False)) == 2.0
    assert slicing.surplus_regularization(totals, mean=True) is None
    grads = [ops.convert_to_tensor([1.0, 1.0]), None, ops.convert_to_tensor(5.0)]
    penalty = [ops.convert_to_tensor([0.5, -0.5]), ops.convert_to_tensor(1.0), None]
    taken = slicing.take_back(grads, penalty, 2.0)
    np.testing.assert_allclose(ops.convert_to_numpy(taken[0]), [0.0, 2.0])
    assert taken[1] is None and float(taken[2]) == 5.0
    # A slice of 2 rows of a batch of 8: its per-row losses count a quarter.
    terms = collections.namedtuple("Terms", "total compiled weights rows")
    t = [ops.convert_to_tensor(v) for v in (0.0, 2.0, 0.5, 3.0)]
    loss = slicing.sum_reduction_loss(terms(*t), 2, 8)
    np.testing.assert_allclose(float(loss), 2.0 + 0.5 + 3.0 / 4)
    assert float(slicing.rows_fraction(0, 0, "float32")) == 0.0


def test_whole_batch_predictions_and_the_state_hand_off():
    from keras import ops

    from keras_fastgrad import _compat
    from keras_fastgrad.step import slicing

    a = np.arange(6, dtype="float32").reshape(3, 2)
    b = np.arange(6, 10, dtype="float32").reshape(2, 2)
    masks = [np.array([True, False, True]), np.array([False, True])]
    groups = [
        ([ops.convert_to_tensor(a), ops.convert_to_tensor(a[:, 0])], [masks[0], None]),
        ([ops.convert_to_tensor(b), ops.convert_to_tensor(b[:, 0])], [masks[1], None]),
    ]
    joined = slicing.whole_batch(groups, {"p": 0, "q": 0})
    np.testing.assert_array_equal(ops.convert_to_numpy(joined["p"]), np.concatenate([a, b]))
    np.testing.assert_array_equal(ops.convert_to_numpy(joined["q"]), [0, 2, 4, 6, 8])
    mask = _compat.get_keras_mask(joined["p"])
    np.testing.assert_array_equal(ops.convert_to_numpy(mask), np.concatenate(masks))
    assert _compat.get_keras_mask(joined["q"]) is None
    before = [ops.zeros((2,), "float32"), ops.zeros((), "int32")]
    after = slicing.hand_off([ops.ones((2,), "float16"), ops.convert_to_tensor(3.0)], before)
    assert [keras.backend.standardize_dtype(v.dtype) for v in after] == ["float32", "int32"]


def test_only_a_single_sum_reduced_loss_with_per_row_terms_is_reweighted():
    import collections

    from keras import ops

    from keras_fastgrad.step import slicing

    terms = collections.namedtuple("Terms", "total compiled weights rows")
    with_rows = terms(*[ops.convert_to_tensor(v) for v in (5.5, 2.0, 0.5, 3.0)])
    without = with_rows._replace(rows=None)
    losses = ["as computed"]
    assert slicing.slice_losses(losses, with_rows, True, False, 2, 8) is losses  # a mean
    assert slicing.slice_losses(losses, with_rows, False, True, 2, 8) is losses  # merged
    assert slicing.slice_losses(losses, without, False, False, 2, 8) is losses
    (loss,) = slicing.slice_losses(losses, with_rows, False, False, 2, 8)
    np.testing.assert_allclose(float(loss), 2.0 + 0.5 + 3.0 * 2 / 8)


def test_after_slices_counts_the_penalty_once_per_batch():
    from keras import ops

    from keras_fastgrad.step import slicing

    # `"sum"`, 3 slices of share 1, each loss holding the penalty 0.5 once:
    # the batch holds it once (2 too many in the loss and the last row).
    one = ops.convert_to_tensor(1.0)
    sums = [[ops.convert_to_tensor([4.0, 1.0])], [ops.convert_to_tensor([3.0, 3.0])]]
    totals = slicing.SliceTotals(sums, ops.convert_to_tensor(9.0), ops.convert_to_tensor(3.0))
    penalty = lambda: (ops.convert_to_tensor(0.5), [ops.convert_to_tensor([1.0, 0.0])])  # noqa: E731
    batch = slicing.after_slices(totals, False, one, penalty)
    np.testing.assert_allclose(float(batch.loss), 8.0)
    np.testing.assert_allclose(float(batch.loss_sum), 8.0)
    np.testing.assert_allclose(ops.convert_to_numpy(batch.sums[0][0]), [4.0, 1.0])
    np.testing.assert_allclose(ops.convert_to_numpy(batch.sums[1][0]), [1.0, 3.0])
    assert float(batch.normaliser) == 1.0
    # Under a mean each slice's `D_i` weighs its penalty: exact, never asked.
    batch = slicing.after_slices(totals, True, one, lambda: pytest.fail("asked"))
    np.testing.assert_allclose(float(batch.loss), 3.0)
    assert float(batch.normaliser) == 3.0
    # No regularised variable: nothing to take back.
    batch = slicing.after_slices(totals, False, one, lambda: None)
    np.testing.assert_allclose(float(batch.loss), 9.0)
