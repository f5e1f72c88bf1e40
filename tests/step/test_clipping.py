"""Unit tests for the pure numeric units, each called directly.

Covers `keras_fastgrad.step.clipping`, `keras_fastgrad.step.finite`,
`keras_fastgrad.step.gradients` and `keras_fastgrad.step.weighting.Share`.

References: every expected value is either worked out by hand (written in
the test, with the arithmetic beside it) or computed by numpy in float64 on
the dense form of the gradients (`np.linalg.norm` of the concatenation,
`np.add.at` for the dense gradient an `tf.IndexedSlices` stands for). No
expected value is taken from the units' own output.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_fastgrad.step import gradients as _gradients

from keras_fastgrad.step import finite
from keras_fastgrad.step.clipping import clip_by_global_norm, global_norm
from keras_fastgrad.step.weighting import Share

NAN, INF = float("nan"), float("inf")


def sparse(values, indices, rows):
    """An `IndexedSlices` of a `[rows, width]` table, and its dense numpy form."""
    values = np.asarray(values, np.float32)
    indices = np.asarray(indices, np.int64)
    dense = np.zeros((rows, values.shape[1]), np.float64)
    np.add.at(dense, indices, values.astype(np.float64))
    slices = tf.IndexedSlices(
        tf.constant(values), tf.constant(indices), tf.constant([rows, values.shape[1]], tf.int64)
    )
    return slices, dense


def np_global_norm(*arrays):
    return np.linalg.norm(np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in arrays]))


def as_numpy(g):
    """Dense numpy value of a gradient (IndexedSlices densified by numpy)."""
    if isinstance(g, tf.IndexedSlices):
        dense = np.zeros(g.dense_shape.numpy(), np.float64)
        np.add.at(dense, g.indices.numpy(), g.values.numpy().astype(np.float64))
        return dense
    return g.numpy()


# ---------------------------------------------------------------- global_norm


class TestGlobalNorm:
    def test_equals_numpy_norm_of_the_concatenation(self):
        rng = np.random.default_rng(0)
        a = rng.normal(size=(3, 4)).astype(np.float32)
        b = rng.normal(size=(5,)).astype(np.float32)
        norm = global_norm([tf.constant(a), tf.constant(b)])
        assert norm.dtype == tf.float32
        np.testing.assert_allclose(float(norm), np_global_norm(a, b), rtol=1e-6)

    def test_by_hand_three_four_twelve(self):
        # sqrt(3^2 + 4^2 + 12^2) = sqrt(169) = 13
        norm = global_norm([tf.constant([3.0, 4.0]), tf.constant([[12.0]])])
        assert float(norm) == 13.0

    def test_none_entries_are_skipped(self):
        norm = global_norm([None, tf.constant([3.0]), None, tf.constant([4.0])])
        assert float(norm) == 5.0

    def test_all_none_or_empty_list_is_zero(self):
        assert float(global_norm([None, None])) == 0.0
        assert float(global_norm([])) == 0.0

    def test_all_zero_gradients_give_zero(self):
        assert float(global_norm([tf.zeros([3]), tf.zeros([2, 2])])) == 0.0

    def test_squares_that_overflow_float32_give_the_finite_true_norm(self):
        # (1e30)^2 = 1e60 overflows float32 (max ~3.4e38); the norm does not.
        a = np.array([1e30, -2e30], np.float32)
        b = np.array([[2e30], [1.0]], np.float32)
        norm = float(global_norm([tf.constant(a), tf.constant(b)]))
        assert np.isfinite(norm)
        # By hand: sqrt(1 + 4 + 4) * 1e30 = 3e30 (the 1.0 is negligible).
        np.testing.assert_allclose(norm, 3e30, rtol=1e-6)
        np.testing.assert_allclose(norm, np_global_norm(a, b), rtol=1e-6)

    def test_overflowing_squares_with_sparse_duplicates(self):
        # Rows 1 and 1 add up to 4e20 before squaring: dense row 1 = [4e20, 3e20]
        slices, dense = sparse([[1e20, 1e20], [3e20, 2e20]], [1, 1], rows=3)
        norm = float(global_norm([slices]))
        np.testing.assert_allclose(norm, 5e20, rtol=1e-6)  # 3-4-5 by hand
        np.testing.assert_allclose(norm, np.linalg.norm(dense), rtol=1e-6)

    def test_norm_beyond_float32_range_is_infinite(self):
        # sqrt(2) * 3e38 = 4.2e38 does not fit in float32: documented limit.
        norm = float(global_norm([tf.constant([3e38, 3e38])]))
        assert norm == INF

    def test_infinite_entry_gives_an_infinite_norm(self):
        norm = float(global_norm([tf.constant([1.0, INF]), tf.constant([2.0])]))
        assert norm == INF  # np.linalg.norm([1, inf, 2]) == inf

    def test_negative_infinite_entry_gives_an_infinite_norm(self):
        assert float(global_norm([tf.constant([-INF, 3.0])])) == INF

    def test_nan_entry_gives_a_nan_norm(self):
        norm = float(global_norm([tf.constant([1.0, NAN]), tf.constant([1e30])]))
        assert np.isnan(norm)  # np.linalg.norm([1, nan, 1e30]) is nan

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
        norm = global_norm([tf.constant([300.0, 300.0], tf.float16)])
        assert norm.dtype == tf.float32
        np.testing.assert_allclose(float(norm), 300.0 * np.sqrt(2.0), rtol=1e-6)

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

    def test_under_xla(self):
        @tf.function(jit_compile=True)
        def clip(g):
            norm = global_norm([g])
            return clip_by_global_norm([g], 1.0, norm)

        clipped, was_clipped = clip(tf.constant([3e20, 4e20]))
        assert bool(was_clipped)
        np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.8], rtol=1e-6)


# --------------------------------------------------------------------- finite


class TestMarks:
    def test_finite_gradients_and_loss(self):
        m = finite.marks([tf.constant([1.0, 2.0]), None, tf.constant([[3.0]])], tf.constant(0.5))
        # by hand: element sums 3, 0 (None), 3, then the loss 0.5
        np.testing.assert_array_equal(m.numpy(), [3.0, 0.0, 3.0, 0.5])
        assert bool(finite.is_finite(m))

    @pytest.mark.parametrize(
        "grads, loss, bad",
        [
            ([[1.0, NAN], [2.0], [3.0]], 0.5, [True, False, False, False]),
            ([[1.0], [INF], [3.0]], 0.5, [False, True, False, False]),
            ([[1.0], [2.0], [-INF, INF]], 0.5, [False, False, True, False]),
            ([[1.0], [2.0], [3.0]], NAN, [False, False, False, True]),
            ([[1.0], [2.0], [3.0]], INF, [False, False, False, True]),
        ],
    )
    def test_flags_exactly_the_bad_entry(self, grads, loss, bad):
        m = finite.marks([tf.constant(g) for g in grads], tf.constant(loss))
        np.testing.assert_array_equal(~np.isfinite(m.numpy()), bad)
        assert bool(finite.is_finite(m)) is (not any(bad))

    def test_sparse_gradient_marked_from_its_rows(self):
        slices, _ = sparse([[1.0, NAN]], [3], rows=5)
        m = finite.marks([tf.constant([1.0]), slices], tf.constant(0.0))
        np.testing.assert_array_equal(~np.isfinite(m.numpy()), [False, True, False])

    def test_no_gradients_marks_only_the_loss(self):
        m = finite.marks([], tf.constant(2.0))
        np.testing.assert_array_equal(m.numpy(), [2.0])
        assert not bool(finite.is_finite(finite.marks([], tf.constant(NAN))))

    def test_float16_loss_and_gradient(self):
        m = finite.marks([tf.constant([1.0, 2.0], tf.float16)], tf.constant(0.25, tf.float16))
        assert m.dtype == tf.float32
        np.testing.assert_array_equal(m.numpy(), [3.0, 0.25])


class TestSummarize:
    def test_first_bad_index_and_count(self):
        m = tf.constant([1.0, NAN, 2.0, INF, -INF, 0.5])  # 5 gradients, loss
        first, count = finite.summarize(m)
        assert (int(first), int(count)) == (1, 3)
        assert first.dtype == tf.int32 and count.dtype == tf.int32

    def test_bad_first_and_last_gradient(self):
        first, count = finite.summarize(tf.constant([NAN, 1.0, INF, 0.0]))
        assert (int(first), int(count)) == (0, 2)
        first, count = finite.summarize(tf.constant([0.0, 1.0, INF, 0.0]))
        assert (int(first), int(count)) == (2, 1)

    def test_only_the_loss_bad_gives_minus_one_and_zero(self):
        first, count = finite.summarize(tf.constant([1.0, 2.0, NAN]))
        assert (int(first), int(count)) == (-1, 0)

    def test_all_finite_gives_minus_one_and_zero(self):
        first, count = finite.summarize(tf.constant([1.0, 2.0, 3.0]))
        assert (int(first), int(count)) == (-1, 0)

    def test_no_gradients(self):
        first, count = finite.summarize(finite.marks([], tf.constant(NAN)))
        assert (int(first), int(count)) == (-1, 0)


class TestFlags:
    def test_to_flags_by_hand(self):
        flags = finite.to_flags(tf.constant([1.0, NAN, INF, -INF, 0.0]))
        assert flags.dtype == tf.float32
        np.testing.assert_array_equal(flags.numpy(), [0.0, 1.0, 1.0, 1.0, 0.0])

    def test_round_trip_keeps_which_entries_are_bad(self):
        m = tf.constant([3.0, NAN, -2.0, INF])
        back = finite.from_flags(finite.to_flags(m)).numpy()
        np.testing.assert_array_equal(np.isnan(back), [False, True, False, True])
        np.testing.assert_array_equal(back[[0, 2]], [0.0, 0.0])
        assert not bool(finite.is_finite(back))
        good = finite.from_flags(finite.to_flags(tf.constant([3.0, -2.0])))
        assert bool(finite.is_finite(good))

    def test_flags_summed_over_replicas_mark_any_bad_replica(self):
        replica_0 = finite.to_flags(tf.constant([NAN, 1.0, 1.0]))
        replica_1 = finite.to_flags(tf.constant([INF, 1.0, NAN]))
        back = finite.from_flags(replica_0 + replica_1).numpy()  # flags [2, 0, 1]
        np.testing.assert_array_equal(np.isnan(back), [True, False, True])
        first, count = finite.summarize(back)
        assert (int(first), int(count)) == (0, 1)  # the loss is not counted


class TestAllFinite:
    def test_dense_sparse_and_none(self):
        slices, _ = sparse([[1.0, 2.0], [3.0, 4.0]], [0, 0], rows=2)
        assert bool(finite.all_finite([tf.constant([1.0]), None, slices]))

    @pytest.mark.parametrize("bad", [NAN, INF, -INF])
    def test_a_bad_dense_element(self, bad):
        assert not bool(finite.all_finite([tf.constant([[1.0, bad]]), None]))

    def test_a_bad_sparse_row(self):
        slices, _ = sparse([[1.0, 2.0], [NAN, 4.0]], [0, 1], rows=2)
        assert not bool(finite.all_finite([tf.constant([1.0]), None, slices]))

    def test_only_none_or_empty_is_finite(self):
        assert bool(finite.all_finite([None, None]))
        assert bool(finite.all_finite([]))

    def test_sum_beyond_float32_range_is_the_documented_false_alarm(self):
        # The module docstring: finite elements whose sum overflows are
        # dropped like a non-finite gradient.
        assert not bool(finite.all_finite([tf.constant([3e38, 3e38])]))

    def test_gradient_sums_by_hand(self):
        slices, _ = sparse([[1.0, 2.0], [3.0, 4.0]], [1, 1], rows=3)
        sums = finite.gradient_sums([tf.constant([[1.0, -4.0]]), None, slices])
        np.testing.assert_array_equal(sums.numpy(), [-3.0, 0.0, 10.0])


# ----------------------------------------------------------------- _gradients


class TestGradientHelpers:
    def test_values_of_dense_sparse_and_none(self):
        dense = tf.constant([1.0, 2.0])
        assert _gradients.values(dense) is dense
        slices, _ = sparse([[5.0, 6.0]], [1], rows=2)
        np.testing.assert_array_equal(_gradients.values(slices).numpy(), [[5.0, 6.0]])
        assert _gradients.values(None) is None

    def test_scale_dense_to_float32(self):
        scaled = _gradients.scale(tf.constant([1.5, -2.0], tf.float16), 4.0)
        assert scaled.dtype == tf.float32
        np.testing.assert_array_equal(scaled.numpy(), [6.0, -8.0])

    def test_scale_sparse_keeps_rows_and_indices(self):
        slices, dense = sparse([[1.0, 2.0], [3.0, 4.0]], [2, 0], rows=3)
        scaled = _gradients.scale(slices, tf.constant(0.5))
        assert isinstance(scaled, tf.IndexedSlices)
        np.testing.assert_array_equal(scaled.indices.numpy(), [2, 0])
        np.testing.assert_array_equal(scaled.dense_shape.numpy(), [3, 2])
        np.testing.assert_array_equal(as_numpy(scaled), dense * 0.5)

    def test_scale_none_is_none(self):
        assert _gradients.scale(None, 3.0) is None

    def test_to_float32(self):
        half = tf.constant([0.5, 1.0], tf.float16)
        cast = _gradients.to_float32(half)
        assert cast.dtype == tf.float32
        np.testing.assert_array_equal(cast.numpy(), [0.5, 1.0])
        already = tf.constant([1.0])
        assert _gradients.to_float32(already) is already
        assert _gradients.to_float32(None) is None
        slices = tf.IndexedSlices(
            tf.constant([[0.25, 2.0]], tf.float16), tf.constant([1]), tf.constant([3, 2])
        )
        cast = _gradients.to_float32(slices)
        assert isinstance(cast, tf.IndexedSlices)
        assert cast.values.dtype == tf.float32
        np.testing.assert_array_equal(cast.values.numpy(), [[0.25, 2.0]])
        np.testing.assert_array_equal(cast.indices.numpy(), [1])

    def test_summed_rows_adds_duplicate_rows(self):
        # indices [2, 0, 2, 2]: row 2 = [1+3+5, 2+4+6] = [9, 12], row 0 = [7, 8]
        slices, dense = sparse(
            [[1.0, 2.0], [7.0, 8.0], [3.0, 4.0], [5.0, 6.0]], [2, 0, 2, 2], rows=4
        )
        rows = _gradients.summed_rows(slices).numpy()
        # one row per distinct index, in any order
        expected = sorted(map(tuple, [[9.0, 12.0], [7.0, 8.0]]))
        assert sorted(map(tuple, rows.tolist())) == expected
        nonzero = dense[np.any(dense != 0, axis=1)]
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, nonzero.tolist()))

    def test_summed_rows_of_dense_and_none(self):
        dense = tf.constant([[1.0, 2.0], [1.0, 2.0]])
        assert _gradients.summed_rows(dense) is dense
        assert _gradients.summed_rows(None) is None


# ------------------------------------------------------------------ weighting


class TestShare:
    def test_mean_reduction_weight_is_actual_times_replicas(self):
        share = Share(tf.constant(6.0), tf.constant(5.0), mean=True)
        assert float(share.loss_weight(1)) == 6.0
        assert float(share.loss_weight(4)) == 24.0  # 6 * 4
        assert float(share.real) == 5.0

    def test_sum_reduction_ignores_replicas(self):
        share = Share(tf.constant(1.0), tf.constant(1.0), mean=False)
        assert float(share.loss_weight(8)) == 1.0
        share = Share(tf.constant(3.0), tf.constant(3.0), mean=False)
        assert float(share.loss_weight(2)) == 3.0

    def test_share_carries_no_gradient(self):
        x = tf.Variable(2.0)
        with tf.GradientTape() as tape:
            share = Share(3.0 * x, 3.0 * x, mean=True)
            weight = share.loss_weight(2)
        assert float(weight) == 12.0  # 3 * 2 * 2 replicas
        assert tape.gradient(weight, x) is None
