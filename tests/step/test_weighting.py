"""Unit tests of `keras_fastgrad.step.weighting.Share`, called directly (the
other units of the step: the other files of `tests/step/`).

References: every expected value is either worked out by hand (written in
the test, with the arithmetic beside it) or computed by numpy in float64 on
the dense form of the gradients (`np.linalg.norm` of the concatenation,
`np.add.at` for the dense gradient an `tf.IndexedSlices` stands for). No
expected value is taken from the units' own output.
"""

import pytest
from keras import ops

from keras_fastgrad.step.weighting import Share
from tests.helpers import tf

# ------------------------------------------------------------------ weighting


class TestShare:
    def test_mean_reduction_weight_is_actual_times_replicas(self):
        share = Share(ops.convert_to_tensor(6.0), ops.convert_to_tensor(5.0), mean=True)
        assert float(share.loss_weight(1)) == 6.0
        assert float(share.loss_weight(4)) == 24.0  # 6 * 4
        assert float(share.real) == 5.0

    def test_sum_reduction_ignores_replicas(self):
        share = Share(ops.convert_to_tensor(1.0), ops.convert_to_tensor(1.0), mean=False)
        assert float(share.loss_weight(8)) == 1.0
        share = Share(ops.convert_to_tensor(3.0), ops.convert_to_tensor(3.0), mean=False)
        assert float(share.loss_weight(2)) == 3.0

    @pytest.mark.tensorflow_only(reason="a tf.GradientTape")
    def test_share_carries_no_gradient(self):
        x = tf.Variable(2.0)
        with tf.GradientTape() as tape:
            share = Share(3.0 * x, 3.0 * x, mean=True)
            weight = share.loss_weight(2)
        assert float(weight) == 12.0  # 3 * 2 * 2 replicas
        assert tape.gradient(weight, x) is None
