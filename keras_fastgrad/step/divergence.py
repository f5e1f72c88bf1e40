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

The rules (`counts_as_failure`, `streak_after`, `loss_result`, `diverged`)
are written once, here, in `keras.ops`; each event's change of the streak
is `keras_fastgrad.step.telemetry`'s (`Change`), which the TensorFlow shell
writes into the streak's variable, the JAX shell into its value in Keras'
state tuple.
"""

import math
import warnings

import keras
from keras import ops


def counts_as_failure(finite, scale=None):
    """Boolean scalar: a dropped micro-batch that counts as a failure.

    Without loss scaling (`scale=None`) every non-finite micro-batch does.
    Under loss scaling an overflow (in the float16 forward pass or the
    scaled gradients) is how the scale finds its level: it halves and the
    next micro-batch usually passes. Only drops once the scale is down to 1
    or below (some 15 halvings from Keras' initial 2**15) count.

    Args:
        finite: Boolean scalar, loss and gradients all finite.
        scale: The loss scale before its update, `None` without scaling.

    Example:

    >>> bool(counts_as_failure(False)), bool(counts_as_failure(False, 2.0))
    (True, False)
    """
    bad = ops.logical_not(finite)
    if scale is None:
        return bad
    return ops.logical_and(bad, ops.less_equal(scale, 1.0))


def failed(finite, scaling):
    """`counts_as_failure` under the step's `LossScaling` unit (its scale
    read only while it scales)."""
    return counts_as_failure(finite, scaling.current_scale() if scaling.active else None)


def failure(failed=None):
    """How much a drop adds to the streak: 1 (`None` or `True`: the drop
    is a failure), else `failed` (boolean scalar) as 0/1."""
    return 1.0 if failed is None or failed is True else ops.cast(failed, "float32")


def streak_after(streak, failed=None, applied=None):
    """The streak after a step: one more where a drop `failed` (see
    `failure`; `False`: no drop), then reset where an update was `applied`
    (boolean scalar or `True`; `None`: none).

    Example:

    >>> float(streak_after(2.0, failed=True)), streak_after(2.0, applied=True)
    (3.0, 0.0)
    """
    if failed is not False:
        streak = streak + failure(failed)
    if applied is True:
        return 0.0
    if applied is not None:
        streak = ops.where(applied, 0.0, streak)
    return streak


def diverged(streak, limit):
    """Python bool: the streak (a number) reached the limit (`None`: never)."""
    return limit is not None and float(streak) >= limit


def loss_result(mean, streak):
    """What the training `loss` logs: NaN while the streak is positive
    (micro-batches are being dropped), else the tracker's `mean`."""
    return ops.where(ops.greater(streak, 0.0), float("nan"), mean)


class DivergenceWatch:
    """The step's failure streak, in a variable saved with the model (the
    shells change it by `keras_fastgrad.step.telemetry.Change`).

    Args:
        limit: Integer >= 1 or `None` (never stop).

    Example:

    >>> watch = DivergenceWatch(limit=2)
    >>> watch.build()
    >>> _ = watch.streak.assign(2.0)
    >>> watch.diverged()
    True
    """

    def __init__(self, limit):
        self.limit = limit
        self.streak = None

    def build(self):
        self.streak = keras.Variable(
            0.0,
            dtype="float32",
            trainable=False,
            autocast=False,
            aggregation="only_first_replica",
            name="nonfinite_streak",
        )

    @property
    def variables(self):
        return [self.streak]

    def diverged(self):
        """Python bool (reads the variable): the streak reached the limit."""
        if self.streak is None:
            return False
        return diverged(keras.ops.convert_to_numpy(self.streak), self.limit)


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
        return loss_result(mean, streak)


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
