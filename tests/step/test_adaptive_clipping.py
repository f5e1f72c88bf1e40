"""Unit tests of `keras_fastgrad.step.adaptive_clipping`, called directly.

Reference: `np_agc` (tests/helpers.py), a numpy (float64) transcription of the NFNets paper's
equation (Brock et al. 2021, eq. 3), written unit by unit with a Python loop
over the output units (moved to the front with `np.moveaxis`), not with the
code's keep-dims broadcasting; sparse gradients are densified by numpy
(`np.add.at`) first. Hand-worked values are written with their arithmetic.
Every random case is checked to clip some units and leave others (a test
that would pass with clipping off is no test).
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_fastgrad.backend.tensorflow.adaptive_clipping import clip_unitwise
from keras_fastgrad.step.adaptive_clipping import both_finite, unit_axes
from tests.helpers import as_numpy, between_middle, np_agc, sparse

NAN, INF = float("nan"), float("inf")


def unit_ratios(g, w, unit_axis=-1):
    """||G_i|| / ||W_i|| per unit (to pick a lambda between them)."""
    g_units = np.moveaxis(np.asarray(g, np.float64), unit_axis, 0)
    w_units = np.moveaxis(np.asarray(w, np.float64), unit_axis, 0)
    return np.array([np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(g_units, w_units)])


def random_case(shape, unit_axis=-1, seed=0):
    """A weight, a gradient whose units have spread-out ratios, and a
    lambda (the median ratio) that clips some units and not others."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape).astype(np.float32)
    g = rng.normal(size=shape).astype(np.float32)
    spread = np.exp(rng.normal(size=shape[unit_axis])).astype(np.float32)
    g = np.moveaxis(np.moveaxis(g, unit_axis, -1) * spread, -1, unit_axis)
    return g, w, between_middle(unit_ratios(g, w, unit_axis))


def clip_in(mode, grads, weights, rows, lam):
    """`clip_unitwise` eagerly (its one-pass `EuclideanNorm`) or inside a
    `tf.function(jit_compile=True)` (XLA has no kernel for that op: the
    three-op norm there); the reference is the same for both."""
    if mode == "eager":
        return clip_unitwise(grads, weights, rows, lam)
    xla = tf.function(lambda g, w: clip_unitwise(g, w, rows, lam), jit_compile=True)
    return xla(grads, weights)


def assert_some_clipped_some_not(n_clipped, n_units):
    assert 0 < n_clipped < n_units


class TestUnitAxes:
    def test_kernels_keep_the_last_axis_tables_the_first(self):
        assert unit_axes(2) == (0,)  # Dense (in, out): a column per unit
        assert unit_axes(3) == (0, 1)  # Conv1D (w, in, out)
        assert unit_axes(4) == (0, 1, 2)  # Conv2D (h, w, in, out)
        assert unit_axes(2, rows=True) == (1,)  # Embedding (vocab, dim)

    def test_vectors_and_scalars_are_one_unit(self):
        assert unit_axes(1) is None
        assert unit_axes(0) is None
        assert unit_axes(1, rows=True) is None


class TestClipUnitwise:
    def test_by_hand_one_dense_unit(self):
        # ||w|| = sqrt(9 + 16) = 5, lambda = 0.1: max norm 0.5;
        # ||g|| = sqrt(36 + 64) = 10 > 0.5: g * 0.5 / 10 = g * 0.05.
        out = clip_unitwise(
            [tf.constant([[6.0], [8.0]])], [tf.constant([[3.0], [4.0]])], [False], 0.1
        )
        np.testing.assert_allclose(out.grads[0].numpy(), [[0.3], [0.4]], rtol=1e-6)
        assert float(out.clipped_units) == 1.0 and out.num_units == 1
        assert bool(out.all_finite)

    def test_by_hand_unit_within_bound_is_unchanged(self):
        # ||w|| = 5, lambda = 1: max norm 5 >= ||g|| = 1: unchanged.
        g = tf.constant([[0.6, 6.0], [0.8, 8.0]])
        w = tf.constant([[3.0, 3.0], [4.0, 4.0]])
        out = clip_unitwise([g], [w], [False], 1.0)
        # Column 0 (||g|| = 1) kept; column 1 (||g|| = 10) scaled by 5/10.
        np.testing.assert_allclose(out.grads[0].numpy(), [[0.6, 3.0], [0.8, 4.0]], rtol=1e-6)
        assert float(out.clipped_units) == 1.0 and out.num_units == 2

    def test_by_hand_eps_for_zero_weights(self):
        # ||w|| = 0 -> max(0, eps=1e-3) = 1e-3; lambda = 0.5: max norm
        # 5e-4; g = [3, 4] (norm 5): g * 5e-4 / 5 = g * 1e-4.
        out = clip_unitwise([tf.constant([3.0, 4.0])], [tf.zeros([2])], [False], 0.5)
        np.testing.assert_allclose(out.grads[0].numpy(), [3e-4, 4e-4], rtol=1e-6)
        # eps = 0.1: max norm 0.05, factor 0.01.
        out = clip_unitwise([tf.constant([3.0, 4.0])], [tf.zeros([2])], [False], 0.5, eps=0.1)
        np.testing.assert_allclose(out.grads[0].numpy(), [0.03, 0.04], rtol=1e-6)

    @pytest.mark.parametrize(
        "shape",
        [(7, 9), (3, 3, 4, 8), (5, 4, 6)],
        ids=["dense", "conv2d", "conv1d"],
    )
    @pytest.mark.parametrize("mode", ["eager", "xla"])
    def test_kernel_matches_the_paper_per_output_unit(self, shape, mode):
        g, w, lam = random_case(shape)
        expected, n_clipped = np_agc(g, w, lam)
        assert_some_clipped_some_not(n_clipped, shape[-1])
        out = clip_in(mode, [tf.constant(g)], [tf.constant(w)], [False], lam)
        np.testing.assert_allclose(out.grads[0].numpy(), expected, rtol=1e-5, atol=1e-7)
        assert float(out.clipped_units) == n_clipped
        assert out.num_units == shape[-1]

    def test_bias_vector_is_one_unit(self):
        # optax's unitwise_norm: vectors are one unit (their whole norm).
        w = np.array([1.0, 2.0, 2.0], np.float32)  # norm 3
        g = np.array([0.0, 3.0, 4.0], np.float32)  # norm 5 > 0.5 * 3
        expected, n = np_agc(g, w, 0.5, unit_axis=None)
        assert n == 1
        out = clip_unitwise([tf.constant(g)], [tf.constant(w)], [False], 0.5)
        np.testing.assert_allclose(out.grads[0].numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(out.grads[0].numpy(), [0.0, 0.9, 1.2], rtol=1e-6)  # * 1.5/5

    def test_embedding_rows_dense_gradient(self):
        g, w, lam = random_case((10, 4), unit_axis=0)
        expected, n_clipped = np_agc(g, w, lam, unit_axis=0)
        assert_some_clipped_some_not(n_clipped, 10)
        out = clip_unitwise([tf.constant(g)], [tf.constant(w)], [True], lam)
        np.testing.assert_allclose(out.grads[0].numpy(), expected, rtol=1e-5, atol=1e-7)
        assert out.num_units == 10

    def test_embedding_sparse_gradient_clipped_on_its_summed_rows(self):
        rng = np.random.default_rng(3)
        w = rng.normal(size=(6, 3)).astype(np.float32)
        values = rng.normal(size=(5, 3)).astype(np.float32)
        values[3] *= 20.0
        slices, dense = sparse(values, [4, 1, 4, 2, 1], rows=6)  # rows 4 and 1 twice
        lam = between_middle(unit_ratios(dense[[1, 2, 4]], w[[1, 2, 4]], unit_axis=0))
        expected, n_clipped = np_agc(dense, w, lam, unit_axis=0)
        assert 0 < n_clipped < 3
        out = clip_unitwise([slices], [tf.constant(w)], [True], lam)
        g = out.grads[0]
        assert isinstance(g, tf.IndexedSlices)  # never made dense
        assert sorted(g.indices.numpy().tolist()) == [1, 2, 4]  # each row once
        np.testing.assert_allclose(as_numpy(g), expected, rtol=1e-5, atol=1e-7)
        assert float(out.clipped_units) == n_clipped
        assert out.num_units == 6  # every row of the table is a unit

    def test_sparse_gradient_of_a_kernel_is_clipped_per_column_densely(self):
        # Rows of a kernel are not its units: the gradient is made dense.
        w = np.arange(1.0, 7.0, dtype=np.float32).reshape(3, 2)
        slices, dense = sparse([[3.0, 0.1], [4.0, 0.1]], [0, 2], rows=3)
        expected, n_clipped = np_agc(dense, w, 0.5)
        assert n_clipped == 1
        out = clip_unitwise([slices], [tf.constant(w)], [False], 0.5)
        np.testing.assert_allclose(as_numpy(out.grads[0]), expected, rtol=1e-6)

    def test_none_gradients_are_kept_and_not_counted(self):
        w = tf.constant([[3.0], [4.0]])
        out = clip_unitwise([None, tf.constant([[6.0], [8.0]])], [w, w], [False, False], 0.1)
        assert out.grads[0] is None
        assert out.num_units == 1

    def test_no_gradient_at_all(self):
        out = clip_unitwise([None], [tf.zeros([2])], [False], 0.1)
        assert out.grads == [None] and bool(out.all_finite) and out.num_units == 0

    def test_counts_units_over_several_weights(self):
        kernel_g, kernel_w, lam = random_case((6, 8), seed=1)
        bias_w = np.ones(8, np.float32)  # norm sqrt(8)
        bias_g = np.full(8, 10.0, np.float32)  # norm 10 sqrt(8): clipped
        _, n_kernel = np_agc(kernel_g, kernel_w, lam)
        out = clip_unitwise(
            [tf.constant(kernel_g), tf.constant(bias_g)],
            [tf.constant(kernel_w), tf.constant(bias_w)],
            [False, False],
            lam,
        )
        assert lam < 10.0  # so the bias is clipped
        assert float(out.clipped_units) == n_kernel + 1
        assert out.num_units == 8 + 1


class TestNonFinite:
    """A non-finite gradient must stay non-finite (or be flagged): AGC must
    never turn it into a finite update."""

    def test_nan_gradient_stays_nan_and_is_flagged(self):
        g = tf.constant([[NAN, 1.0], [1.0, 1.0]])
        out = clip_unitwise([g], [tf.ones([2, 2])], [False], 0.01)
        assert not bool(out.all_finite)
        assert np.isnan(out.grads[0].numpy()[:, 0]).any()

    def test_inf_gradient_becomes_nan_not_zero(self):
        g = tf.constant([[INF, 1.0], [1.0, 1.0]])
        out = clip_unitwise([g], [tf.ones([2, 2])], [False], 0.01)
        assert not bool(out.all_finite)
        assert not np.isfinite(out.grads[0].numpy()[:, 0]).all()

    def test_nan_in_a_sparse_row_is_flagged(self):
        slices, _ = sparse([[NAN, 1.0]], [1], rows=3)
        out = clip_unitwise([slices], [tf.ones([3, 2])], [True], 0.01)
        assert not bool(out.all_finite)

    @pytest.mark.parametrize("mode", ["eager", "xla"])
    def test_finite_gradient_whose_unit_norm_overflows_is_flagged(self, mode):
        # ||[1e20, 1e20]||^2 = 2e40 overflows float32: the factor would be
        # max_norm / inf = 0, a silently zero unit; it is flagged instead.
        g = tf.constant([[1e20], [1e20]])
        out = clip_in(mode, [g], [tf.ones([2, 1])], [False], 0.01)
        assert np.isfinite(g.numpy()).all()
        assert not bool(out.all_finite)

    def test_finite_gradient_is_finite_after_clipping(self):
        g, w, lam = random_case((4, 5))
        out = clip_unitwise([tf.constant(g * 1e15)], [tf.constant(w)], [False], lam)
        assert bool(out.all_finite)
        assert np.isfinite(out.grads[0].numpy()).all()

    def test_both_finite(self):
        t, f = tf.constant(True), tf.constant(False)
        assert both_finite(None, None) is None
        assert both_finite(t, None) is t
        assert both_finite(None, f) is f
        assert not bool(both_finite(t, f)) and not bool(both_finite(f, t))
        assert bool(both_finite(t, t))
