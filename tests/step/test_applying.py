"""Unit tests of `keras_fastgrad.backend.tensorflow.applying.apply_if`, called directly
(split from the step's unit tests, now `tests/step/`).

`apply_if` is checked by which variables each branch assigned. No expected
value is taken from the unit's own output.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastgrad.backend.tensorflow.applying import apply_if

NAN = float("nan")


# ------------------------------------------------------------------- apply_if


def branch_variables():
    return tf.Variable(0.0), tf.Variable(0.0)


class TestApplyIf:
    @pytest.mark.parametrize("condition", [True, False])
    def test_eager_python_condition(self, condition):
        applied, skipped = branch_variables()
        apply_if(condition, lambda: applied.assign(1.0), otherwise=lambda: skipped.assign(1.0))
        assert (float(applied.numpy()), float(skipped.numpy())) == (
            (1.0, 0.0) if condition else (0.0, 1.0)
        )

    @pytest.mark.parametrize("condition", [True, False])
    def test_eager_tensor_condition_with_args(self, condition):
        applied, skipped = branch_variables()
        apply_if(
            tf.constant(condition),
            lambda grads, x: applied.assign(tf.reduce_sum(grads[0]) * x),
            args=([tf.constant([1.0, 2.0]), tf.constant([3.0])], tf.constant(2.0)),
            otherwise=lambda y: skipped.assign(y),
            otherwise_args=(tf.constant(-7.0),),
        )
        # by hand: (1 + 2) * 2 = 6
        assert (float(applied.numpy()), float(skipped.numpy())) == (
            (6.0, 0.0) if condition else (0.0, -7.0)
        )

    def test_without_otherwise_a_false_condition_does_nothing(self):
        applied, _ = branch_variables()
        apply_if(tf.constant(False), lambda: applied.assign(1.0))
        assert float(applied.numpy()) == 0.0

    def test_in_tf_function_exactly_one_branch_runs(self):
        applied, skipped = branch_variables()

        @tf.function
        def step(condition, g):
            apply_if(
                condition,
                lambda g: applied.assign_add(g),
                args=(g,),
                otherwise=lambda: skipped.assign_add(1.0),
            )

        step(tf.constant(True), tf.constant(5.0))
        step(tf.constant(False), tf.constant(100.0))
        step(tf.constant(True), tf.constant(2.0))
        assert float(applied.numpy()) == 7.0  # 5 + 2
        assert float(skipped.numpy()) == 1.0

    def test_in_tf_function_python_condition(self):
        applied, skipped = branch_variables()

        @tf.function
        def step():
            apply_if(False, lambda: applied.assign(1.0), otherwise=lambda: skipped.assign(1.0))

        step()
        assert (float(applied.numpy()), float(skipped.numpy())) == (0.0, 1.0)

    def test_optimizer_update_under_one_device_strategy(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            v = keras.Variable([1.0, 2.0])
            optimizer = keras.optimizers.SGD(1.0)
            optimizer.build([v])
            skipped = tf.Variable(0.0)

        def replica_step(condition, g):
            apply_if(
                condition,
                lambda grads: optimizer.apply(grads, [v]),
                args=([g],),
                otherwise=lambda: skipped.assign_add(1.0),
            )

        @tf.function
        def step(condition, g):
            strategy.run(replica_step, args=(condition, g))

        step(tf.constant(True), tf.constant([0.5, 0.5]))
        step(tf.constant(False), tf.constant([NAN, NAN]))
        # SGD(1.0): [1, 2] - [0.5, 0.5]; the NaN step is skipped
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [0.5, 1.5])
        assert float(skipped.numpy()) == 1.0
        assert int(optimizer.iterations.numpy()) == 1

    def test_cross_replica_context_runs_directly(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            applied, skipped = branch_variables()
            assert tf.distribute.get_replica_context() is None
            apply_if(
                tf.constant(True),
                lambda x: applied.assign(x),
                args=(tf.constant(3.0),),
                otherwise=lambda: skipped.assign(1.0),
            )
        assert (float(applied.numpy()), float(skipped.numpy())) == (3.0, 0.0)

    def test_python_true_traces_no_cond(self):
        # A condition known when traced (`skip_nonfinite=False`: every
        # gradient goes on) costs no `cond`: no `If` op in the graph.
        applied, skipped = branch_variables()

        @tf.function
        def step(g):
            apply_if(True, lambda x: applied.assign_add(x), args=(g,), otherwise=skipped.assign)

        graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
        assert not [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        step(tf.constant(2.0))
        step(tf.constant(3.0))
        assert (float(applied.numpy()), float(skipped.numpy())) == (5.0, 0.0)  # 2 + 3

    def test_python_true_optimizer_update_under_one_device_strategy(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            v = keras.Variable([1.0, 2.0])
            optimizer = keras.optimizers.SGD(1.0)
            optimizer.build([v])

        @tf.function
        def step(g):
            strategy.run(
                lambda g: apply_if(True, lambda grads: optimizer.apply(grads, [v]), args=([g],)),
                args=(g,),
            )

        step(tf.constant([0.5, 0.25]))
        # SGD(1.0): [1, 2] - [0.5, 0.25]
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [0.5, 1.75])
        assert int(optimizer.iterations.numpy()) == 1
