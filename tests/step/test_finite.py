"""Unit tests of the finite check, called directly (the other units of the step:
the other files of `tests/step/`): `keras_fastgrad.backend.tensorflow.finite` on
TensorFlow, `keras_fastgrad.maths.finite` (what the JAX step calls) under
`KERAS_BACKEND=jax`; sparse gradients and the replicas' flags are
TensorFlow's alone (`tensorflow_only`).

References: every expected value is either worked out by hand (written in
the test, with the arithmetic beside it) or computed by numpy in float64 on
the dense form of the gradients (`np.linalg.norm` of the concatenation,
`np.add.at` for the dense gradient an `tf.IndexedSlices` stands for). No
expected value is taken from the units' own output.
"""

import keras
import numpy as np
import pytest

from tests.helpers import sparse

if keras.backend.backend() == "tensorflow":
    from keras_fastgrad.backend.tensorflow import finite
else:  # the JAX step's unit
    from keras_fastgrad.maths import finite

NAN, INF = float("nan"), float("inf")
TF_ONLY = pytest.mark.tensorflow_only(reason="tf.IndexedSlices and the replicas' flags")


def const(value, dtype="float32"):
    return keras.ops.convert_to_tensor(np.asarray(value, dtype))


def np_of(x):
    return keras.ops.convert_to_numpy(x)


def dtype_of(x):
    return keras.backend.standardize_dtype(x.dtype)


# --------------------------------------------------------------------- finite


class TestMarks:
    def test_finite_gradients_and_loss(self):
        m = finite.marks([const([1.0, 2.0]), None, const([[3.0]])], const(0.5))
        # by hand: element sums 3, 0 (None), 3, then the loss 0.5
        np.testing.assert_array_equal(np_of(m), [3.0, 0.0, 3.0, 0.5])
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
        m = finite.marks([const(g) for g in grads], const(loss))
        np.testing.assert_array_equal(~np.isfinite(np_of(m)), bad)
        assert bool(finite.is_finite(m)) is (not any(bad))

    @TF_ONLY
    def test_sparse_gradient_marked_from_its_rows(self):
        slices, _ = sparse([[1.0, NAN]], [3], rows=5)
        m = finite.marks([const([1.0]), slices], const(0.0))
        np.testing.assert_array_equal(~np.isfinite(np_of(m)), [False, True, False])

    def test_no_gradients_marks_only_the_loss(self):
        m = finite.marks([], const(2.0))
        np.testing.assert_array_equal(np_of(m), [2.0])
        assert not bool(finite.is_finite(finite.marks([], const(NAN))))

    def test_float16_loss_and_gradient(self):
        m = finite.marks([const([1.0, 2.0], "float16")], const(0.25, "float16"))
        assert dtype_of(m) == "float32"
        np.testing.assert_array_equal(np_of(m), [3.0, 0.25])


class TestSummarize:
    def test_first_bad_index_and_count(self):
        m = const([1.0, NAN, 2.0, INF, -INF, 0.5])  # 5 gradients, loss
        first, count = finite.summarize(m)
        assert (int(first), int(count)) == (1, 3)
        assert dtype_of(first) == "int32" and dtype_of(count) == "int32"

    def test_bad_first_and_last_gradient(self):
        first, count = finite.summarize(const([NAN, 1.0, INF, 0.0]))
        assert (int(first), int(count)) == (0, 2)
        first, count = finite.summarize(const([0.0, 1.0, INF, 0.0]))
        assert (int(first), int(count)) == (2, 1)

    def test_only_the_loss_bad_gives_minus_one_and_zero(self):
        first, count = finite.summarize(const([1.0, 2.0, NAN]))
        assert (int(first), int(count)) == (-1, 0)

    def test_all_finite_gives_minus_one_and_zero(self):
        first, count = finite.summarize(const([1.0, 2.0, 3.0]))
        assert (int(first), int(count)) == (-1, 0)

    def test_no_gradients(self):
        first, count = finite.summarize(finite.marks([], const(NAN)))
        assert (int(first), int(count)) == (-1, 0)


@TF_ONLY
class TestFlags:
    def test_to_flags_by_hand(self):
        flags = finite.to_flags(const([1.0, NAN, INF, -INF, 0.0]))
        assert dtype_of(flags) == "float32"
        np.testing.assert_array_equal(np_of(flags), [0.0, 1.0, 1.0, 1.0, 0.0])

    def test_round_trip_keeps_which_entries_are_bad(self):
        m = const([3.0, NAN, -2.0, INF])
        back = np_of(finite.from_flags(finite.to_flags(m)))
        np.testing.assert_array_equal(np.isnan(back), [False, True, False, True])
        np.testing.assert_array_equal(back[[0, 2]], [0.0, 0.0])
        assert not bool(finite.is_finite(back))
        good = finite.from_flags(finite.to_flags(const([3.0, -2.0])))
        assert bool(finite.is_finite(good))

    def test_flags_summed_over_replicas_mark_any_bad_replica(self):
        replica_0 = finite.to_flags(const([NAN, 1.0, 1.0]))
        replica_1 = finite.to_flags(const([INF, 1.0, NAN]))
        back = np_of(finite.from_flags(replica_0 + replica_1))  # flags [2, 0, 1]
        np.testing.assert_array_equal(np.isnan(back), [True, False, True])
        first, count = finite.summarize(back)
        assert (int(first), int(count)) == (0, 1)  # the loss is not counted


class TestAllFinite:
    @TF_ONLY
    def test_dense_sparse_and_none(self):
        slices, _ = sparse([[1.0, 2.0], [3.0, 4.0]], [0, 0], rows=2)
        assert bool(finite.all_finite([const([1.0]), None, slices]))

    @pytest.mark.parametrize("bad", [NAN, INF, -INF])
    def test_a_bad_dense_element(self, bad):
        assert not bool(finite.all_finite([const([[1.0, bad]]), None]))

    @TF_ONLY
    def test_a_bad_sparse_row(self):
        slices, _ = sparse([[1.0, 2.0], [NAN, 4.0]], [0, 1], rows=2)
        assert not bool(finite.all_finite([const([1.0]), None, slices]))

    def test_only_none_or_empty_is_finite(self):
        assert bool(finite.all_finite([None, None]))
        assert bool(finite.all_finite([]))

    def test_sum_beyond_float32_range_is_the_documented_false_alarm(self):
        # The module docstring: finite elements whose sum overflows are
        # dropped like a non-finite gradient.
        assert not bool(finite.all_finite([const([3e38, 3e38])]))

    @TF_ONLY
    def test_gradient_sums_by_hand(self):
        slices, _ = sparse([[1.0, 2.0], [3.0, 4.0]], [1, 1], rows=3)
        sums = finite.marks([const([[1.0, -4.0]]), None, slices], const(0.5))
        np.testing.assert_array_equal(np_of(sums), [-3.0, 0.0, 10.0, 0.5])
