"""Unit tests of `keras_fastgrad.backend.tensorflow.clipping`, called directly (the other units of the step:
the other files of `tests/step/`).

References: every expected value is either worked out by hand (written in
the test, with the arithmetic beside it) or computed by numpy in float64 on
the dense form of the gradients (`np.linalg.norm` of the concatenation,
`np.add.at` for the dense gradient an `tf.IndexedSlices` stands for). No
expected value is taken from the units' own output.
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import as_numpy, sparse

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    from keras_fastgrad.backend.tensorflow import finite
    from keras_fastgrad.backend.tensorflow.clipping import clip_by_global_norm, global_norm
else:  # the JAX step's (`maths.norms.global_norm`, dense)
    from keras_fastgrad.maths.norms import global_norm
TF_ONLY = pytest.mark.tensorflow_only(
    reason="None entries, tf.IndexedSlices, TF's clip signature and tf.function"
)


def const(value, dtype="float32"):
    return keras.ops.convert_to_tensor(np.asarray(value, dtype))


NAN, INF = float("nan"), float("inf")


def np_global_norm(*arrays):
    return np.linalg.norm(np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in arrays]))


# ---------------------------------------------------------------- global_norm


class TestGlobalNorm:
    def test_equals_numpy_norm_of_the_concatenation(self):
        rng = np.random.default_rng(0)
        a = rng.normal(size=(3, 4)).astype(np.float32)
        b = rng.normal(size=(5,)).astype(np.float32)
        norm = global_norm([const(a), const(b)])
        assert keras.backend.standardize_dtype(norm.dtype) == "float32"
        np.testing.assert_allclose(float(norm), np_global_norm(a, b), rtol=1e-6)

    def test_by_hand_three_four_twelve(self):
        # sqrt(3^2 + 4^2 + 12^2) = sqrt(169) = 13
        norm = global_norm([const([3.0, 4.0]), const([[12.0]])])
        assert float(norm) == 13.0

    @TF_ONLY
    def test_none_entries_are_skipped(self):
        norm = global_norm([None, tf.constant([3.0]), None, tf.constant([4.0])])
        assert float(norm) == 5.0

    @TF_ONLY
    def test_all_none_or_empty_list_is_zero(self):
        assert float(global_norm([None, None])) == 0.0
        assert float(global_norm([])) == 0.0

    def test_all_zero_gradients_give_zero(self):
        assert float(global_norm([keras.ops.zeros([3]), keras.ops.zeros([2, 2])])) == 0.0

    def test_squares_that_overflow_float32_give_the_finite_true_norm(self):
        # (1e30)^2 = 1e60 overflows float32 (max ~3.4e38); the norm does not.
        a = np.array([1e30, -2e30], np.float32)
        b = np.array([[2e30], [1.0]], np.float32)
        norm = float(global_norm([const(a), const(b)]))
        assert np.isfinite(norm)
        # By hand: sqrt(1 + 4 + 4) * 1e30 = 3e30 (the 1.0 is negligible).
        np.testing.assert_allclose(norm, 3e30, rtol=1e-6)
        np.testing.assert_allclose(norm, np_global_norm(a, b), rtol=1e-6)

    @TF_ONLY
    def test_overflowing_squares_with_sparse_duplicates(self):
        # Rows 1 and 1 add up to 4e20 before squaring: dense row 1 = [4e20, 3e20]
        slices, dense = sparse([[1e20, 1e20], [3e20, 2e20]], [1, 1], rows=3)
        norm = float(global_norm([slices]))
        np.testing.assert_allclose(norm, 5e20, rtol=1e-6)  # 3-4-5 by hand
        np.testing.assert_allclose(norm, np.linalg.norm(dense), rtol=1e-6)

    def test_norm_beyond_float32_range_is_infinite(self):
        # sqrt(2) * 3e38 = 4.2e38 does not fit in float32: documented limit.
        norm = float(global_norm([const([3e38, 3e38])]))
        assert norm == INF

    def test_infinite_entry_gives_an_infinite_norm(self):
        norm = float(global_norm([const([1.0, INF]), const([2.0])]))
        assert norm == INF  # np.linalg.norm([1, inf, 2]) == inf

    def test_negative_infinite_entry_gives_an_infinite_norm(self):
        assert float(global_norm([const([-INF, 3.0])])) == INF

    def test_nan_entry_gives_a_nan_norm(self):
        norm = float(global_norm([const([1.0, NAN]), const([1e30])]))
        assert np.isnan(norm)  # np.linalg.norm([1, nan, 1e30]) is nan

    @TF_ONLY
    def test_indexed_slices_are_measured_as_their_dense_gradient(self):
        # Duplicate index 0: rows [1, 2] + [2, 2] = [3, 4] -> norm 5 by hand;
        # summing squares of the stored rows instead would give sqrt(13).
        slices, dense = sparse([[1.0, 2.0], [2.0, 2.0]], [0, 0], rows=4)
        assert float(global_norm([slices])) == 5.0
        mixed = global_norm([slices, None, tf.constant([12.0])])
        np.testing.assert_allclose(float(mixed), np_global_norm(dense, [12.0]), rtol=1e-6)
        assert float(mixed) == 13.0

    def test_float16_gradients_are_measured_in_float32(self):
        # 300^2 * 2 = 180000 overflows float16 (max 65504), not float32.
        norm = global_norm([const([300.0, 300.0], "float16")])
        assert keras.backend.standardize_dtype(norm.dtype) == "float32"
        np.testing.assert_allclose(float(norm), 300.0 * np.sqrt(2.0), rtol=1e-6)

    @TF_ONLY
    def test_under_xla_overflow_and_sparse(self):
        slices, dense = sparse([[1e30, 0.0], [1e30, 0.0]], [2, 2], rows=3)
        a = np.array([3e30, 1.0], np.float32)

        @tf.function(jit_compile=True)
        def norm(values, indices, a):
            return global_norm(
                [tf.IndexedSlices(values, indices, tf.constant([3, 2], tf.int64)), a]
            )

        result = float(norm(slices.values, slices.indices, tf.constant(a)))
        np.testing.assert_allclose(result, np_global_norm(dense, a), rtol=1e-6)
        np.testing.assert_allclose(result, np.hypot(2e30, 3e30), rtol=1e-6)


# -------------------------------------------------------- clip_by_global_norm


@TF_ONLY
class TestClipByGlobalNorm:
    def test_scales_by_clip_over_norm_when_norm_exceeds_clip(self):
        grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]
        clipped, was_clipped = clip_by_global_norm(grads, 2.0, tf.constant(5.0))
        assert bool(was_clipped)
        # factor 2/5 = 0.4 by hand
        np.testing.assert_allclose(clipped[0].numpy(), [1.2, 0.0], rtol=1e-6)
        np.testing.assert_allclose(clipped[1].numpy(), [[1.6]], rtol=1e-6)
        np.testing.assert_allclose(float(global_norm(clipped)), 2.0, rtol=1e-6)

    def test_leaves_gradients_unchanged_at_or_below_clip(self):
        grads = [tf.constant([3.0, 4.0])]
        for norm in (5.0, 4.0, 0.0):  # equal to clip_norm, below, zero
            clipped, was_clipped = clip_by_global_norm(grads, 5.0, tf.constant(norm))
            assert not bool(was_clipped)
            np.testing.assert_array_equal(clipped[0].numpy(), [3.0, 4.0])

    def test_none_stays_none_and_sparse_stays_sparse(self):
        slices, dense = sparse([[3.0, 0.0], [0.0, 4.0]], [0, 2], rows=3)
        clipped, _ = clip_by_global_norm([None, slices], 1.0, tf.constant(5.0))
        assert clipped[0] is None
        assert isinstance(clipped[1], tf.IndexedSlices)
        np.testing.assert_array_equal(clipped[1].indices.numpy(), [0, 2])
        np.testing.assert_allclose(as_numpy(clipped[1]), dense / 5.0, rtol=1e-6)

    def test_huge_norm_gives_exactly_clip_norm(self):
        grads = [tf.constant([6e19, 0.0]), tf.constant([8e19])]  # norm 1e20
        norm = global_norm(grads)
        np.testing.assert_allclose(float(norm), 1e20, rtol=1e-6)
        clipped, was_clipped = clip_by_global_norm(grads, 1.0, norm)
        assert bool(was_clipped)
        np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.0], rtol=1e-6)
        np.testing.assert_allclose(clipped[1].numpy(), [0.8], rtol=1e-6)
        np.testing.assert_allclose(float(global_norm(clipped)), 1.0, rtol=1e-6)

    def test_overflowing_norm_clips_to_clip_norm(self):
        grads = [tf.constant([3e30, 4e30])]
        clipped, was_clipped = clip_by_global_norm(grads, 10.0, global_norm(grads))
        assert bool(was_clipped)
        np.testing.assert_allclose(clipped[0].numpy(), [6.0, 8.0], rtol=1e-6)

    @pytest.mark.parametrize("bad_norm", [INF, NAN])
    def test_non_finite_norm_makes_every_gradient_nan(self, bad_norm):
        # The docstring: "An infinite or NaN `norm` gives non-finite gradients".
        slices, _ = sparse([[1.0, 2.0]], [1], rows=2)
        grads = [tf.constant([1.0, 2.0]), None, slices]
        clipped, _ = clip_by_global_norm(grads, 1.0, tf.constant(bad_norm))
        assert np.all(np.isnan(clipped[0].numpy()))
        assert clipped[1] is None
        assert isinstance(clipped[2], tf.IndexedSlices)
        assert np.all(np.isnan(clipped[2].values.numpy()))
        # so the step's finite check drops the update
        assert not bool(finite.all_finite(clipped))

    def test_infinite_norm_with_zero_gradient_is_still_dropped(self):
        # Zero * inf would be NaN anyway, but a *finite* zero gradient with an
        # infinite norm must not pass as finite: the NaN scale guarantees it.
        clipped, _ = clip_by_global_norm([tf.zeros([2])], 1.0, tf.constant(INF))
        assert not bool(finite.all_finite(clipped))

    def test_checked_norm_clips_alike_without_the_nan_guard(self):
        # `checked`: the step applies the result only with a finite norm
        # (its verdict or its check before the update): no guard traced.
        grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]

        @tf.function
        def clip(norm):
            return clip_by_global_norm(grads, 2.0, norm, checked=True)

        clipped, was_clipped = clip(tf.constant(5.0))
        assert bool(was_clipped)
        # factor 2/5 = 0.4 by hand
        np.testing.assert_allclose(clipped[0].numpy(), [1.2, 0.0], rtol=1e-6)
        np.testing.assert_allclose(clipped[1].numpy(), [[1.6]], rtol=1e-6)
        graph = clip.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
        assert "IsFinite" not in {op.type for op in graph.get_operations()}

    def test_under_xla(self):
        @tf.function(jit_compile=True)
        def clip(g):
            norm = global_norm([g])
            return clip_by_global_norm([g], 1.0, norm)

        clipped, was_clipped = clip(tf.constant([3e20, 4e20]))
        assert bool(was_clipped)
        np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.8], rtol=1e-6)


# ------------------------------------------------- maths.norms.clip (the rule)


class TestClipRule:
    """`maths.norms.clip`, the clip both shells call: factor, norm, whether it
    clips, and its check (`fits_clip`), worked out by hand."""

    def test_factor_norm_and_check_by_hand(self):
        from keras_fastgrad.maths import norms

        # ||[3, 4]|| = 5 > 1: factor 1 / 5 = 0.2, a normal float: applied.
        c = norms.clip(1.0, [const([3.0, 4.0])], fit=True)
        assert (float(c.factor), float(c.norm), bool(c.was_clipped), bool(c.ok)) == (
            pytest.approx(0.2),
            5.0,
            True,
            True,
        )
        # ||[0.3, 0.4]|| = 0.5 <= 1: factor 1, nothing asked of the check.
        c = norms.clip(1.0, [const([0.3, 0.4])])
        assert float(c.factor) == 1.0 and not bool(c.was_clipped) and c.ok is None
        assert norms.clip(None, [const([3.0])]) is None

    @pytest.mark.parametrize("clip_norm", [1.0, 10.0])  # 10 / tiny is +inf in float32
    @pytest.mark.parametrize("bad", [NAN, INF])
    def test_a_non_finite_norm_is_refused_and_its_factor_nan(self, clip_norm, bad):
        from keras_fastgrad.maths import norms

        c = norms.clip(clip_norm, [const([1.0, bad])], fit=True)
        assert not bool(c.ok)
        assert np.isnan(float(c.factor))  # unchecked: NaN, as Keras' clipping
        assert not bool(norms.fits_clip(clip_norm, 1.0, const(bad)))

    def test_a_norm_beyond_clip_norm_over_tiny_is_refused(self):
        from keras_fastgrad.maths import norms

        # 2**80 * 1e20 ~ 1.2e44 > 1 / 1.18e-38: a subnormal factor.
        assert not bool(norms.fits_clip(1.0, 2.0**80, const(1e20)))
        c = norms.clip(1.0, checked=True, fit=True, scaled=(const(2.0**80), const(1e20)))
        assert not bool(c.ok) and bool(c.was_clipped)

    @pytest.mark.parametrize(
        "clip_norm, unit, root",
        [
            (1.0, 1.0, 5.0),  # 1 / 5
            (1.0, 1.0, 3.0),  # 1 / 3, rounded once
            (0.7, 1.0, 1e19),
            (1.0, 2.0**80, 1e-4),  # a rescaled norm, ~1.2e20
            (3.0, 2.0**80, 12345.678),  # ~1.5e28
            (10.0, 2.0**80, 4.2e14),  # ~5.1e38: beyond float32, within 10 / tiny ~ 8.5e38
        ],
    )
    def test_the_factor_is_clip_norm_over_the_norm_rounded_once(self, clip_norm, unit, root):
        from keras_fastgrad.maths import norms

        # By hand: clip_norm / (unit * root) in float64 (`unit` a power of
        # two: the product is exact), rounded to float32 once.
        root = np.float32(root)
        exact = np.float32(np.float64(clip_norm) / (np.float64(unit) * np.float64(root)))
        # (unchecked, a norm beyond float32 gives NaN: `test_a_non_finite_...`)
        within = np.float64(unit) * np.float64(root) < np.finfo(np.float32).max
        for checked in (True, False) if within else (True,):
            c = norms.clip(clip_norm, checked=checked, scaled=(const(unit), const(root)))
            assert float(c.factor) == float(exact) and bool(c.was_clipped)

    @pytest.mark.parametrize(
        "clip_norm, unit, root, fits",
        [
            (1.0, 1.0, 3.0, True),
            (1.0, 2.0**80, 1e-4, True),  # ~1.2e20 <= 1 / tiny ~ 8.5e37
            (1.0, 2.0**80, 1e20, False),  # ~1.2e44: a subnormal factor
            (10.0, 2.0**80, 4.2e14, True),  # ~5.1e38 (no float32) <= 10 / tiny ~ 8.5e38
        ],
    )
    def test_the_fitted_norm_checks_and_clips_as_the_norm_it_came_from(
        self, clip_norm, unit, root, fits
    ):
        from keras_fastgrad.maths import norms

        root = np.float32(root)
        got, scaled = norms.fitted(clip_norm, const(unit), const(root))
        assert bool(got) == fits
        if fits:  # clipped only where it fits: the factor by hand, as above
            exact = np.float32(np.float64(clip_norm) / (np.float64(unit) * np.float64(root)))
            c = norms.clip(clip_norm, checked=True, scaled=scaled)
            assert float(c.factor) == float(exact) and bool(c.was_clipped)


# ------------------------------------------ the step, a norm at float32's edges


@pytest.mark.parametrize(
    "clip_norm, x, clipped",
    [
        (1.0, [3.0, 4.0], [0.6, 0.8]),  # norm 5: factor 1 / 5
        (1.0, [3e30, 4e30], [0.6, 0.8]),  # norm 5e30: its squares overflow
        # norm 3e38 * sqrt(2) ~ 4.24e38, beyond float32 (~3.4e38) but within
        # 10 / tiny (~8.5e38): a normal factor, each element 10 / sqrt(2)
        (10.0, [3e38, 3e38], [10.0 / np.sqrt(2.0)] * 2),
    ],
)
def test_the_step_clips_a_norm_its_squares_or_float32_cannot_hold(clip_norm, x, clipped):
    """One update of `FastGradModel(clip_norm=...)` with SGD(1): the loss
    `x @ w` (w = 0) has the gradient `x`, clipped by hand to `clipped`; the
    weights move by minus that, the update counted as clipped."""
    inputs = keras.Input((2,))
    model = keras_fastgrad.FastGradModel(
        inputs,
        keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs),
        clip_norm=clip_norm,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y, p: keras.ops.sum(p))
    model.fit(np.array([x], np.float32), np.zeros((1, 1), np.float32), batch_size=1, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0][:, 0], -np.array(clipped), rtol=1e-6)
    counters = model.telemetry_counters()
    assert (counters["updates"], counters["clipped_updates"], counters["nonfinite_count"]) == (
        1.0,
        1.0,
        0.0,
    )


@pytest.mark.parametrize("features", [2, 10])
def test_a_norm_beyond_clip_norm_over_tiny_is_dropped_not_applied_as_zero(features):
    """`clip_norm=10`: `10 / tiny` (~8.5e38) is beyond float32, so the fit
    cannot be checked on the norm (+inf for both). A finite gradient of
    `features` elements 3e38: norm ~4.2e38 (2 elements) fits, a normal
    factor, applied; ~9.5e38 (10 elements) does not: its factor would be
    below tiny (flushed to 0 on CPUs), so the update is dropped and
    counted, the weights left as they were (not a zero update counted as
    applied)."""
    inputs = keras.Input((features,))
    model = keras_fastgrad.FastGradModel(
        inputs,
        keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs),
        clip_norm=10.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y, p: keras.ops.sum(p))
    x = np.full((1, features), 3e38, np.float32)
    model.fit(x, np.zeros((1, 1), np.float32), batch_size=1, verbose=0)
    norm = 3e38 * np.sqrt(features)  # by hand, in float64
    counters = model.telemetry_counters()
    if norm <= 10.0 / float(np.finfo(np.float32).tiny):  # (in float64)
        np.testing.assert_allclose(
            model.get_weights()[0][:, 0], -10.0 / np.sqrt(features) * np.ones(features), rtol=1e-6
        )
        assert (counters["updates"], counters["nonfinite_count"]) == (1.0, 0.0)
    else:
        np.testing.assert_array_equal(model.get_weights()[0], np.zeros((features, 1)))
        assert (counters["updates"], counters["nonfinite_count"]) == (0.0, 1.0)
