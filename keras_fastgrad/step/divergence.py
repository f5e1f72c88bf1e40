"""Divergence: a streak of dropped micro-batches stops training.

Dropping a non-finite micro-batch keeps the weights safe, but a run whose
weights were blown up by finite gradients (a learning-rate spike) drops
every micro-batch from then on and would otherwise look quiet. Following
optax's `apply_if_finite(max_consecutive_errors)`:

- `streak` counts the failures since the last applied update: each dropped
  micro-batch and each window dropped at its update (an accumulated sum
  that overflowed). An applied update resets it. Under loss scaling an
  overflow while the scale is still above 1 is the scale's normal search,
  not a failure (see `failed`).
- The logged `loss` (`TrainingLoss`) is NaN for a period in which nothing
  was kept, and while the latest micro-batches are being dropped: best-
  checkpoint selection (`ModelCheckpoint(save_best_only=True)`,
  `EarlyStopping(restore_best_weights=True)`) never picks such a period.
- `DivergenceStop`, added to every `fit` of a model with
  `max_consecutive_nonfinite` set, stops training with a warning when the
  streak reaches the limit (read asynchronously, at no cost to the step).
"""

import math
import warnings

import keras

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.step.variables import global_variable


class DivergenceWatch:
    """The step's failure streak, in a variable saved with the model.

    Args:
        limit: Integer >= 1 or `None` (never stop).

    Example:

    >>> watch = DivergenceWatch(limit=2)
    >>> watch.build()
    >>> watch.record_drop(tf.constant(True))
    >>> watch.record_drop(tf.constant(True))
    >>> watch.diverged()
    True
    >>> watch.record_update()
    >>> watch.diverged()
    False
    """

    def __init__(self, limit):
        self.limit = limit
        self.streak = None

    def build(self):
        self.streak = global_variable(0.0, "nonfinite_streak")

    @property
    def variables(self):
        return [self.streak]

    def record_drop(self, failed=None):
        """Adds a failure when `failed` (boolean scalar, the same on every
        replica; `None`: the drop is one)."""
        increment(self.streak, 1.0 if failed is None else tf.where(failed, 1.0, 0.0))

    def record_update(self):
        """An update was applied (inside the update branch)."""
        self.streak.assign(0.0)

    def diverged(self):
        """Python bool (reads the variable): the streak reached the limit."""
        if self.limit is None or self.streak is None:
            return False
        return float(self.streak.numpy()) >= self.limit


def failed(finite, scaling):
    """Boolean scalar: a dropped micro-batch that counts as a failure.

    Without loss scaling every non-finite micro-batch does. Under loss
    scaling an overflow (in the float16 forward pass or the scaled
    gradients) is how the scale finds its level: it halves and the next
    micro-batch usually passes. Only drops once the scale is down to 1 or
    below (some 15 halvings from Keras' initial 2**15) count.

    Args:
        finite: Boolean scalar, loss and gradients all finite.
        scaling: The step's `LossScaling` unit (before its update).
    """
    bad = tf.logical_not(finite)
    if not scaling.active:
        return bad
    return tf.logical_and(bad, scaling.current_scale() <= 1.0)


class TrainingLoss(keras.metrics.Mean):
    """Keras' `loss` tracker, honest about dropped micro-batches.

    Its result is NaN when nothing was kept in the period (a mean of no
    values: Keras' `Mean` says 0.0), or while the step's latest
    micro-batches are being dropped (the divergence streak is positive).

    Args:
        name: The metric's name, `"loss"` as Keras'.
        streak: Optional callable returning the streak variable while
            training (`None` while evaluating: a validation loss measures
            the weights, whatever training is doing).

    Example:

    >>> tracker = TrainingLoss()
    >>> float(tracker.result())  # nothing kept yet
    nan
    >>> tracker.update_state(2.0, sample_weight=4.0)
    >>> float(tracker.result())
    2.0
    """

    def __init__(self, name="loss", streak=None, dtype=None):
        super().__init__(name=name, dtype=dtype)
        self._streak = streak

    def result(self):
        # 0 / 0 is NaN: a period with nothing kept (Keras' `Mean` divides
        # with `divide_no_nan` and says 0.0).
        mean = self.total / self.count
        streak = None if self._streak is None else self._streak()
        if streak is None:
            return mean
        return tf.where(streak > 0.0, tf.constant(float("nan"), mean.dtype), mean)


class DivergenceStop(keras.callbacks.Callback):
    """Stops `fit` when the model's failure streak reaches its limit.

    `FastGradModel.fit` adds it. It runs on Keras' asynchronous callback
    thread and reads the model's streak variable only when the logged
    `loss` is not finite (`TrainingLoss` is NaN whenever the streak is
    positive), so a healthy run pays a dictionary lookup per batch.
    """

    async_safe = True  # reads one variable; does not need the logs in order

    def __init__(self, watch):
        super().__init__()
        # A callable giving the model's `DivergenceWatch` (`None` until the
        # step's state exists, which the first train step builds).
        self.watch = watch
        self.stopped = False

    def on_train_batch_end(self, batch, logs=None):
        if self.stopped:
            return
        loss = (logs or {}).get("loss")
        if isinstance(loss, float) and math.isfinite(loss):
            return  # a finite logged loss means the streak is 0: no read
        watch = self.watch()
        if watch is None or not watch.diverged():
            return
        self.stopped = True
        self.model.stop_training = True
        warnings.warn(
            f"FastGradModel: training stopped after {watch.limit} "
            "consecutive non-finite micro-batches (a diverged run: every "
            "micro-batch since the last update had NaN/Inf in its loss or "
            "gradients, or its window overflowed). None of them reached the "
            "weights; the periods they fell in log `loss=nan`, so best-"
            "checkpoint callbacks kept earlier weights. Fix: a lower "
            "learning rate or `clip_norm`, and restore a checkpoint "
            "(`EarlyStopping(restore_best_weights=True)` does on its own). "
            "To keep going regardless, pass "
            "`max_consecutive_nonfinite=None`.",
            RuntimeWarning,
            stacklevel=2,
        )
