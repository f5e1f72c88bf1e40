"""Unit tests for `keras_fastgrad.step.loss_scaling.LossScaling`, called directly.

References: scales are worked out by hand from Keras' documented dynamic
loss scaling rule (`keras.optimizers.LossScaleOptimizer`: initial scale
2**15; on a non-finite step halve the scale and restart the count; after
`dynamic_growth_steps` finite steps in a row, 2000 by default, double it)
and, in one test, compared step by step with Keras' own
`LossScaleOptimizer.apply` driven through the same finite/non-finite
sequence. Gradients come from `tf.GradientTape` on a linear loss `x . v`,
whose true gradient `x` is known by hand. No expected value is taken from
the unit's own output.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_fastgrad.backend.tensorflow.loss_scaling import LossScaling

NAN = float("nan")


def built_lso(**kwargs):
    v = keras.Variable([1.0, 2.0])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), **kwargs)
    opt.build([v])
    return opt, v


def linear_grads(scaling, weight=None):
    """Gradient of `scaling.scale(x . v, weight)` unscaled; true one is `x`."""
    v = tf.Variable([1.0, 2.0])
    x = tf.constant([3.0, -5.0])
    with tf.GradientTape() as tape:
        scaled = scaling.scale(tf.reduce_sum(x * v), weight)
    raw = tape.gradient(scaled, v)
    return raw, scaling.unscale([raw, None], weight)


class TestLossScalingInactive:
    def test_plain_optimizer_is_identity(self):
        scaling = LossScaling(keras.optimizers.SGD())
        assert not scaling.active
        assert scaling.factor is None
        loss = tf.constant(2.5)
        assert float(scaling.scale(loss)) == 2.5
        grads = [tf.constant([1.0, 2.0]), None]
        assert scaling.unscale(grads) is grads
        assert float(scaling.current_scale()) == 1.0

    def test_weight_goes_into_the_loss_without_scaling(self):
        scaling = LossScaling(keras.optimizers.SGD())
        assert float(scaling.scale(tf.constant(2.5), tf.constant(4.0))) == 10.0
        raw, grads = linear_grads(scaling, tf.constant(4.0))
        np.testing.assert_array_equal(grads[0].numpy(), [12.0, -20.0])  # 4 * x
        assert grads[1] is None

    def test_update_does_nothing(self):
        scaling = LossScaling(keras.optimizers.SGD())
        scaling.update(tf.constant(False))
        assert float(scaling.current_scale()) == 1.0


class TestLossScalingDynamic:
    def test_keras_documented_defaults(self):
        opt, _ = built_lso()
        scaling = LossScaling(opt)
        assert scaling.active
        assert scaling.update_optimizer is opt.inner_optimizer
        assert float(scaling.current_scale()) == 2.0**15
        assert opt.dynamic_growth_steps == 2000

    def test_scale_and_unscale_by_the_current_scale(self):
        opt, _ = built_lso(initial_scale=8.0)
        scaling = LossScaling(opt)
        assert float(scaling.scale(tf.constant(2.5))) == 20.0  # 2.5 * 8
        raw, grads = linear_grads(scaling)
        np.testing.assert_array_equal(raw.numpy(), [24.0, -40.0])  # 8 * x
        np.testing.assert_array_equal(grads[0].numpy(), [3.0, -5.0])
        assert grads[1] is None

    def test_weight_is_folded_into_the_unscaling_not_the_loss(self):
        opt, _ = built_lso(initial_scale=8.0)
        scaling = LossScaling(opt)
        # the scaled loss does not grow by the weight (float16 headroom)
        assert float(scaling.scale(tf.constant(2.5), tf.constant(4.0))) == 20.0
        raw, grads = linear_grads(scaling, tf.constant(4.0))
        np.testing.assert_array_equal(raw.numpy(), [24.0, -40.0])
        np.testing.assert_array_equal(grads[0].numpy(), [12.0, -20.0])  # 4 * x

    def test_unscale_keeps_sparse_gradients_sparse(self):
        opt, _ = built_lso(initial_scale=4.0)
        scaling = LossScaling(opt)
        g = tf.IndexedSlices(
            tf.constant([[8.0, 4.0]], tf.float16), tf.constant([1]), tf.constant([3, 2])
        )
        (out,) = scaling.unscale([g])
        assert isinstance(out, tf.IndexedSlices)
        assert out.values.dtype == tf.float32
        np.testing.assert_array_equal(out.values.numpy(), [[2.0, 1.0]])

    def test_non_finite_halves_and_restarts_the_count(self):
        opt, _ = built_lso()
        scaling = LossScaling(opt)
        scaling.update(tf.constant(True))
        scaling.update(tf.constant(True))
        assert int(opt.step_counter.numpy()) == 2
        scaling.update(tf.constant(False))
        assert float(scaling.current_scale()) == 2.0**14
        assert int(opt.step_counter.numpy()) == 0
        for _ in range(20):  # no lower bound, as in Keras
            scaling.update(tf.constant(False))
        assert float(scaling.current_scale()) == 2.0**-6

    def test_doubles_after_exactly_2000_finite_steps_by_default(self):
        opt, _ = built_lso()
        scaling = LossScaling(opt)

        @tf.function
        def finite_steps(n):
            for _ in tf.range(n):
                scaling.update(tf.constant(True))

        finite_steps(tf.constant(1999))
        assert float(scaling.current_scale()) == 2.0**15
        assert int(opt.step_counter.numpy()) == 1999
        finite_steps(tf.constant(1))
        assert float(scaling.current_scale()) == 2.0**16
        assert int(opt.step_counter.numpy()) == 0
        finite_steps(tf.constant(2000))
        assert float(scaling.current_scale()) == 2.0**17

    def test_sequence_by_hand_with_growth_every_two_steps(self):
        opt, _ = built_lso(initial_scale=16.0, dynamic_growth_steps=2)
        scaling = LossScaling(opt)
        sequence = [True, True, True, False, True, False, False, True, True]
        # scale after each step, by the rule: x2 on the 2nd finite in a row
        expected = [16, 32, 32, 16, 16, 8, 4, 4, 8]
        got = []
        for finite in sequence:
            scaling.update(tf.constant(finite))
            got.append(float(scaling.current_scale()))
        assert got == expected

    def test_matches_keras_loss_scale_optimizer_on_the_same_sequence(self):
        ours, _ = built_lso(initial_scale=64.0, dynamic_growth_steps=3)
        scaling = LossScaling(ours)
        keras_opt, keras_v = built_lso(initial_scale=64.0, dynamic_growth_steps=3)
        sequence = [True, True, True, True, False, True, True, False, True, True, True, True]
        for finite in sequence:
            g = tf.constant([1.0, 1.0]) if finite else tf.constant([NAN, 1.0])
            keras_opt.apply([g], [keras_v])  # Keras' own rule
            scaling.update(tf.constant(finite))
            assert float(ours.dynamic_scale.numpy()) == float(keras_opt.dynamic_scale.numpy())
            assert int(ours.step_counter.numpy()) == int(keras_opt.step_counter.numpy())

    def test_under_accumulation_growth_counts_updates_not_micro_batches(self):
        # Windows of 2 micro-batches: Keras' optimizer sees one step per
        # window (the big batch), finite when both micro-batches are; an
        # overflowing micro-batch halves at once and its window's update
        # (of the other micro-batch) still counts, as an applied update.
        ours, _ = built_lso(initial_scale=64.0, dynamic_growth_steps=2)
        scaling = LossScaling(ours)
        keras_opt, keras_v = built_lso(initial_scale=64.0, dynamic_growth_steps=2)
        windows = [(True, True), (True, True), (True, True), (False, True), (True, True)]
        # By hand: x2 after updates 2 and 4, /2 at the overflow (which
        # restarts the count before its window's update: 1 after it).
        expected = [64, 128, 128, 64, 128]
        got = []
        for window in windows:
            for finite in window:
                scaling.update(tf.constant(finite), counts_growth=False)
            scaling.record_update()
            got.append(float(scaling.current_scale()))
        assert got == expected
        for window in windows[:3]:  # Keras on the big batches of the finite windows
            keras_opt.apply([tf.constant([1.0, 1.0])], [keras_v])
        ours_first_three = LossScaling(built_lso(initial_scale=64.0, dynamic_growth_steps=2)[0])
        for window in windows[:3]:
            for finite in window:
                ours_first_three.update(tf.constant(finite), counts_growth=False)
            ours_first_three.record_update()
        assert float(ours_first_three.current_scale()) == float(keras_opt.dynamic_scale.numpy())
        assert int(ours_first_three.scaler.step_counter.numpy()) == int(
            keras_opt.step_counter.numpy()
        )

    def test_apply_uses_the_inner_optimizer_without_unscaling_again(self):
        opt, v = built_lso(initial_scale=8.0)
        scaling = LossScaling(opt)
        scaling.apply([tf.constant([0.5, 1.0])], [v])  # SGD(1.0): v -= g
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [0.5, 1.0])
        assert float(scaling.current_scale()) == 8.0  # scale left to `update`


class TestLossScalingFixedFactor:
    def test_scale_and_unscale_by_the_factor(self):
        opt = keras.optimizers.SGD(1.0, loss_scale_factor=128.0)
        scaling = LossScaling(opt)
        assert not scaling.active
        assert scaling.factor == 128.0
        assert float(scaling.current_scale()) == 128.0
        assert float(scaling.scale(tf.constant(0.5))) == 64.0
        raw, grads = linear_grads(scaling, tf.constant(2.0))
        np.testing.assert_array_equal(raw.numpy(), [384.0, -640.0])  # 128 * x
        np.testing.assert_array_equal(grads[0].numpy(), [6.0, -10.0])  # 2 * x

    def test_update_leaves_the_factor(self):
        scaling = LossScaling(keras.optimizers.SGD(1.0, loss_scale_factor=128.0))
        scaling.update(tf.constant(False))
        assert float(scaling.current_scale()) == 128.0

    def test_apply_does_not_divide_by_the_factor_again_and_restores_it(self):
        opt = keras.optimizers.SGD(1.0, loss_scale_factor=4.0)
        v = keras.Variable([1.0, 2.0])
        scaling = LossScaling(opt)
        scaling.apply([tf.constant([0.5, 1.0])], [v])
        # Keras' own apply would subtract g / 4 = [0.125, 0.25]
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [0.5, 1.0])
        assert opt.loss_scale_factor == 4.0

    def test_loss_scale_optimizer_clears_the_inner_factor(self):
        inner = keras.optimizers.SGD(1.0, loss_scale_factor=4.0)
        opt = keras.optimizers.LossScaleOptimizer(inner)
        assert LossScaling(opt).factor is None
