"""Unit tests of the accumulation window on TensorFlow
(`keras_fastgrad.backend.tensorflow.accumulation` on a
`keras_fastgrad.step.accumulation.WindowAccumulator`), called directly (the other units of the step: the other files of
`tests/step/`).

References: window sums and normalisers are compared with numpy sums of the
same weighted gradients (`np.add.at` for the dense form of a
`tf.IndexedSlices`) or with sums worked out by hand in the test; the
window-complete signal with the micro-step count by hand. No expected value
is taken from the units' own output.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_fastgrad.backend.tensorflow import accumulation as tf_window
from keras_fastgrad.step.accumulation import MicroBatch, WindowAccumulator

NAN, INF = float("nan"), float("inf")


def add_micro_batch(acc, weighted_grads, normaliser, keep, otherwise=None):
    """`tf_window.add` of one micro-batch."""
    return tf_window.add(acc, MicroBatch(weighted_grads, normaliser, keep), otherwise=otherwise)


# ---------------------------------------------------------- WindowAccumulator


def three_variables():
    """A dense matrix, a dense vector and an embedding-like table."""
    return [
        keras.Variable(np.zeros((2, 3), np.float32), name="kernel"),
        keras.Variable(np.zeros((3,), np.float32), name="bias"),
        keras.Variable(np.zeros((4, 2), np.float32), name="table"),
    ]


def sparse_rows(values, indices, rows=4):
    values = np.asarray(values, np.float32)
    slices = tf.IndexedSlices(
        tf.constant(values),
        tf.constant(indices, tf.int64),
        tf.constant([rows, values.shape[1]], tf.int64),
    )
    dense = np.zeros((rows, values.shape[1]), np.float64)
    np.add.at(dense, np.asarray(indices), values.astype(np.float64))
    return slices, dense


def micro_batches(seed=0):
    """Three micro-batches: (dense grads, sparse table grad, its dense form, D_j)."""
    rng = np.random.default_rng(seed)
    batches = []
    for j, (indices, d) in enumerate([([0, 2], 4.0), ([2, 2, 3], 2.0), ([1], 6.0)]):
        kernel = rng.normal(size=(2, 3)).astype(np.float32)
        bias = rng.normal(size=(3,)).astype(np.float32)
        table, table_dense = sparse_rows(rng.normal(size=(len(indices), 2)), indices)
        batches.append(((kernel, bias), table, table_dense, d))
    return batches


class TestWindowAccumulator:
    def test_build_creates_float32_zero_state(self):
        variables = three_variables() + [keras.Variable(np.ones(2, np.float16), dtype="float16")]
        acc = WindowAccumulator(steps=3)
        acc.build(variables)
        assert len(acc.sums) == 4
        for total, v in zip(acc.sums, variables):
            assert tuple(total.shape) == tuple(v.shape)
            assert total.dtype == "float32"
            assert not total.trainable
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(total), 0.0)
        assert float(acc.normaliser.numpy()) == 0.0
        assert int(acc.micro_step.numpy()) == 0
        assert int(acc.included.numpy()) == 0
        assert len(acc.variables) == 7  # 4 sums, normaliser, micro_step, included
        assert not bool(acc.has_samples())

    def test_window_sums_and_normaliser_equal_numpy_sums(self):
        variables = three_variables()
        acc = WindowAccumulator(steps=3)
        acc.build(variables)
        sums = [np.zeros((2, 3)), np.zeros((3,)), np.zeros((4, 2))]
        normaliser = 0.0
        done = []
        for (kernel, bias), table, table_dense, d in micro_batches():
            # the step passes gradients already multiplied by D_j
            weighted = [
                tf.constant(kernel * d),
                tf.constant(bias * d),
                tf.IndexedSlices(table.values * d, table.indices, table.dense_shape),
            ]
            done.append(bool(add_micro_batch(acc, weighted, tf.constant(d), tf.constant(True))))
            sums = [s + w for s, w in zip(sums, [kernel * d, bias * d, table_dense * d])]
            normaliser += d
        assert done == [False, False, True]
        assert float(acc.normaliser.numpy()) == 12.0  # 4 + 2 + 6
        assert normaliser == 12.0
        for got, want in zip(tf_window.window_sums(acc), sums):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
        # the update's gradient: sum_j D_j g_j / sum_j D_j
        mean = tf_window.window_sums(acc)[0] / acc.normaliser
        np.testing.assert_allclose(mean.numpy(), sums[0] / 12.0, rtol=1e-6, atol=1e-6)
        assert bool(acc.has_samples())

    def test_by_hand_docstring_like_window(self):
        v = keras.Variable([0.0, 0.0])
        acc = WindowAccumulator(steps=2)
        acc.build([v])
        add_micro_batch(acc, [tf.constant([2.0, -1.0])], 1.0, tf.constant(True))
        add_micro_batch(acc, [tf.constant([4.0, 1.0])], 3.0, tf.constant(True))
        # (2 + 4) / (1 + 3) = 1.5, (-1 + 1) / 4 = 0
        np.testing.assert_array_equal(
            (tf_window.window_sums(acc)[0] / acc.normaliser).numpy(), [1.5, 0.0]
        )

    def test_sparse_gradient_adds_to_its_rows_only_with_duplicates(self):
        v = keras.Variable(np.zeros((4, 2), np.float32))
        acc = WindowAccumulator(steps=2)
        acc.build([v])
        slices, dense = sparse_rows([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [3, 0, 3])
        add_micro_batch(acc, [slices], 1.0, tf.constant(True))
        # by hand: row 3 = [1 + 5, 2 + 6], row 0 = [3, 4], rows 1, 2 untouched
        expected = [[3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [6.0, 8.0]]
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), expected)
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), dense)

    def test_float16_gradients_are_summed_in_float32(self):
        v = keras.Variable(np.zeros(2, np.float16), dtype="float16")
        acc = WindowAccumulator(steps=2)
        acc.build([v])
        # 60000 + 60000 overflows float16 (max 65504), not float32
        for _ in range(2):
            add_micro_batch(acc, [tf.constant([60000.0, 0.5], tf.float16)], 1.0, tf.constant(True))
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), [120000.0, 1.0])

    def test_none_gradient_leaves_its_sum_and_template_none(self):
        variables = three_variables()
        acc = WindowAccumulator(steps=2)
        acc.build(variables)
        add_micro_batch(acc, [None, tf.constant([1.0, 2.0, 3.0]), None], 2.0, tf.constant(True))
        template = [None, tf.zeros([3]), None]
        sums = tf_window.window_sums(acc, template)
        assert sums[0] is None and sums[2] is None
        np.testing.assert_array_equal(sums[1].numpy(), [1.0, 2.0, 3.0])
        untemplated = tf_window.window_sums(acc)
        np.testing.assert_array_equal(untemplated[0].numpy(), np.zeros((2, 3)))
        np.testing.assert_array_equal(untemplated[2].numpy(), np.zeros((4, 2)))

    def test_left_out_micro_batch_adds_nothing_and_runs_otherwise(self):
        variables = three_variables()
        acc = WindowAccumulator(steps=3)
        acc.build(variables)
        ran = []
        good = [tf.ones([2, 3]), tf.ones([3]), sparse_rows([[1.0, 1.0]], [1])[0]]
        bad = [
            tf.fill([2, 3], NAN),
            tf.constant([INF, 0.0, 0.0]),
            sparse_rows([[NAN, 1.0]], [2])[0],
        ]
        assert not bool(
            add_micro_batch(acc, good, 5.0, tf.constant(True), otherwise=lambda: ran.append(1))
        )
        assert ran == []
        assert not bool(
            add_micro_batch(acc, bad, 7.0, tf.constant(False), otherwise=lambda: ran.append(2))
        )
        assert ran == [2]
        # the left-out step still counts towards the window
        assert bool(add_micro_batch(acc, [None, None, None], 0.0, tf.constant(False)))
        assert int(acc.micro_step.numpy()) == 3
        assert float(acc.normaliser.numpy()) == 5.0  # 7 and 0 left out
        sums = [s.numpy() for s in tf_window.window_sums(acc)]
        np.testing.assert_array_equal(sums[0], np.ones((2, 3)))
        np.testing.assert_array_equal(sums[1], np.ones(3))
        np.testing.assert_array_equal(sums[2], [[0, 0], [1, 1], [0, 0], [0, 0]])

    def test_window_of_only_left_out_batches_has_no_samples(self):
        v = keras.Variable([0.0])
        acc = WindowAccumulator(steps=2)
        acc.build([v])
        add_micro_batch(acc, [tf.constant([NAN])], 3.0, tf.constant(False))
        assert not bool(acc.has_samples())
        # Included with no counted element (every weight 0): Keras would
        # still step on that batch, with a zero gradient.
        add_micro_batch(acc, [tf.constant([0.0])], 0.0, tf.constant(True))
        assert bool(acc.has_samples())
        assert float(acc.normaliser.numpy()) == 0.0
        tf_window.reset(acc)
        assert not bool(acc.has_samples())

    def test_window_complete_every_steps_micro_steps(self):
        v = keras.Variable([0.0])
        acc = WindowAccumulator(steps=3)
        acc.build([v])
        signals = [
            bool(add_micro_batch(acc, [tf.constant([1.0])], 1.0, tf.constant(True)))
            for _ in range(7)
        ]
        assert signals == [False, False, True, False, False, True, False]

    @staticmethod
    def _one_micro_batch_into_a_window_of_two():
        acc = WindowAccumulator(steps=2)
        acc.build([keras.Variable([0.0, 0.0])])
        add_micro_batch(acc, [tf.constant([1.0, 2.0])], 2.0, tf.constant(True))
        return acc

    def test_reset_empties_sums_but_keeps_counting(self):
        acc = self._one_micro_batch_into_a_window_of_two()
        tf_window.reset(acc)
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), [0.0, 0.0])
        assert float(acc.normaliser.numpy()) == 0.0
        assert int(acc.micro_step.numpy()) == 1
        # micro-step 2 still closes the window begun before the reset
        assert bool(add_micro_batch(acc, [tf.constant([3.0, 4.0])], 1.0, tf.constant(True)))
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), [3.0, 4.0])
        assert float(acc.normaliser.numpy()) == 1.0

    def test_flush_applies_a_window_with_samples_then_starts_at_micro_step_zero(self):
        acc = self._one_micro_batch_into_a_window_of_two()
        applied = []
        tf_window.flush(acc, lambda: applied.append(tf_window.window_sums(acc)[0].numpy()))
        assert len(applied) == 1 and applied[0].tolist() != [0.0, 0.0]
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), [0.0, 0.0])
        assert float(acc.normaliser.numpy()) == 0.0
        assert int(acc.micro_step.numpy()) == 0
        assert not bool(add_micro_batch(acc, [tf.constant([3.0, 4.0])], 1.0, tf.constant(True)))
        assert bool(add_micro_batch(acc, [tf.constant([3.0, 4.0])], 1.0, tf.constant(True)))

    def test_in_tf_function_only_the_chosen_branch_runs(self):
        variables = three_variables()
        acc = WindowAccumulator(steps=4)
        acc.build(variables)
        skipped = tf.Variable(0)

        @tf.function
        def add(kernel, bias, values, indices, d, include):
            table = tf.IndexedSlices(values, indices, tf.constant([4, 2], tf.int64))
            return add_micro_batch(
                acc, [kernel, bias, table], d, include, otherwise=lambda: skipped.assign_add(1)
            )

        sums = [np.zeros((2, 3)), np.zeros((3,)), np.zeros((4, 2))]
        normaliser = 0.0
        includes = [True, False, True, True]
        for ((kernel, bias), table, table_dense, d), include in zip(
            micro_batches(seed=1) + [micro_batches(seed=2)[0]], includes
        ):
            if not include:
                kernel = np.full_like(kernel, NAN)
            done = add(
                kernel * d,
                bias * d,
                table.values * d,
                table.indices,
                tf.constant(d),
                tf.constant(include),
            )
            if include:
                sums = [s + w for s, w in zip(sums, [kernel * d, bias * d, table_dense * d])]
                normaliser += d
        assert bool(done)
        assert int(skipped.numpy()) == 1
        np.testing.assert_allclose(float(acc.normaliser.numpy()), normaliser)
        for got, want in zip(tf_window.window_sums(acc), sums):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)

    def test_python_true_includes_every_micro_batch_without_a_cond(self):
        # `skip_nonfinite=False`: nothing is left out, known when traced.
        variables = three_variables()
        acc = WindowAccumulator(steps=3)
        acc.build(variables)

        @tf.function
        def add(kernel, bias, values, indices, d):
            table = tf.IndexedSlices(values, indices, tf.constant([4, 2], tf.int64))
            return add_micro_batch(acc, [kernel, bias, table], d, True)

        sums = [np.zeros((2, 3)), np.zeros((3,)), np.zeros((4, 2))]
        done = []
        for (kernel, bias), table, table_dense, d in micro_batches(seed=3):
            done.append(bool(add(kernel * d, bias * d, table.values * d, table.indices, d)))
            sums = [s + w for s, w in zip(sums, [kernel * d, bias * d, table_dense * d])]
        graph = add.get_concrete_function(
            *(tf.TensorSpec(s, t) for s, t in [((2, 3), tf.float32), ((3,), tf.float32)]),
            tf.TensorSpec((None, 2), tf.float32),
            tf.TensorSpec((None,), tf.int64),
            tf.TensorSpec((), tf.float32),
        ).graph
        assert not [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        assert done == [False, False, True]
        assert float(acc.normaliser.numpy()) == 12.0  # 4 + 2 + 6
        assert int(acc.included.numpy()) == 3
        for got, want in zip(tf_window.window_sums(acc), sums):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)

    def test_under_xla_with_a_sparse_gradient(self):
        table = keras.Variable(np.zeros((4, 2), np.float32))
        acc = WindowAccumulator(steps=2)
        acc.build([table])

        @tf.function(jit_compile=True)
        def add(values, indices, include):
            g = tf.IndexedSlices(values, indices, tf.constant([4, 2], tf.int64))
            return add_micro_batch(acc, [g], tf.constant(2.0), include)

        first, dense_1 = sparse_rows([[1.0, 2.0], [3.0, 4.0]], [1, 1])
        second, _ = sparse_rows([[NAN, 0.0]], [0])
        assert not bool(add(first.values, first.indices, tf.constant(True)))
        assert bool(add(second.values, second.indices, tf.constant(False)))
        np.testing.assert_array_equal(tf_window.window_sums(acc)[0].numpy(), dense_1)
        assert float(acc.normaliser.numpy()) == 2.0
