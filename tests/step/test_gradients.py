"""Unit tests of `keras_fastgrad.backend.tensorflow.gradients`, called directly (the other units of the step:
the other files of `tests/step/`).

References: every expected value is either worked out by hand (written in
the test, with the arithmetic beside it) or computed by numpy in float64 on
the dense form of the gradients (`np.linalg.norm` of the concatenation,
`np.add.at` for the dense gradient an `tf.IndexedSlices` stands for). No
expected value is taken from the units' own output.
"""

import numpy as np
import tensorflow as tf

from keras_fastgrad.backend.tensorflow import gradients as _gradients
from tests.helpers import as_numpy, sparse

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
