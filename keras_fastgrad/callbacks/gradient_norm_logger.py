"""`GradientNormLogger`: puts the step's gradient measurements into the logs
and, optionally, into TensorBoard (written from the host)."""

from keras_fastgrad import _compat as compat
from keras_fastgrad.callbacks import _base
from keras_fastgrad.callbacks._tensorboard import SummaryWriter
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION, is_task_key

CLIPPED_FRACTION = "clipped_fraction"


class GradientNormLogger(_base.FastGradCallback):
    """Logs the gradient norm measured inside the compiled train step.

    `grad_norm` is the global L2 norm, before clipping, of the gradient of
    the model's most recent optimizer update. It is computed in the train
    step (eager, compiled and XLA alike) and arrives with the step's logs, so it
    shows in the progress bar, `History` and `CSVLogger` with no extra pass
    over the data. Values added by this callback (`clipped_fraction`) reach
    only the callbacks listed after it: put it before `CSVLogger`.

    Args:
        per_layer: Boolean, defaults to `False`. Also logs
            `grad_norm/<layer>`, the norm of each layer's part of the
            gradient (`model.layer_norm_keys()` lists the keys).
        clip_fraction: Boolean, defaults to `False`. Also logs
            `clipped_fraction`: the fraction of the epoch's optimizer updates
            whose gradient was clipped (per epoch, not cumulative: computed
            on the host from the step's cumulative `clipped_updates` and
            `updates` counters, as the difference between the epoch's begin
            and end; in batch logs, the fraction so far in the epoch; 0 when
            the epoch made no update). Needs `FastGradModel(clip_norm=...)`.
        update_ratio: Boolean, defaults to `False`. Also logs
            `update_ratio`, `||w_after - w_before|| / ||w_before||` of the
            latest update (costs one copy of the weights per update).
        adaptive_fraction: Boolean, defaults to `False`. Also logs
            `agc_clipped_fraction`: the fraction of units whose gradient
            adaptive gradient clipping clipped in the latest update
            (counted in the step only then). Needs
            `FastGradModel(clip_adaptive=...)`.
        tensorboard_dir: Directory path or `None` (default). When set, the
            logged values are also written as TensorBoard scalars by a
            `tf.summary` file writer on the host (into
            `<tensorboard_dir>/train`, with Keras' `epoch_`/`batch_` tag
            prefixes, next to `keras.callbacks.TensorBoard`'s curves). A
            multi-task model's task keys (`task_grad_norm/<task>`,
            `task_cosine/<a>/<b>`, `task_conflicts`) are written too.
        histogram_freq: Integer >= 0, defaults to `0`. Every
            `histogram_freq` epochs, writes a histogram of each trainable
            weight (tag: the weight's path) to TensorBoard. This is the only
            time the callback reads weights to the host. Needs
            `tensorboard_dir`.
        update_freq: `"epoch"` (default), `"batch"` or an integer >= 1: how
            often scalars go to TensorBoard. `"batch"` writes after every
            train function call (every `steps_per_execution` batches), an
            integer N after calls at least N batches apart.

    Raises:
        TypeError, ValueError: for invalid arguments, naming the argument,
            the rule and the value received; at `fit`, `ValueError` when the
            model is not a `FastGradModel`, or when `clip_fraction=True` and
            the model does not clip.

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1, name="head")(inputs), clip_norm=1.0)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> logger = keras_fastgrad.callbacks.GradientNormLogger(
    ...     per_layer=True, clip_fraction=True)
    >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,
    ...                     callbacks=[logger])
    >>> sorted(k for k in history.history if "norm" in k or "clip" in k)
    ['clipped_fraction', 'clipped_updates', 'grad_norm', 'grad_norm/head']
    """

    def __init__(
        self,
        per_layer=False,
        clip_fraction=False,
        update_ratio=False,
        adaptive_fraction=False,
        tensorboard_dir=None,
        histogram_freq=0,
        update_freq="epoch",
    ):
        super().__init__()
        self.per_layer = _base.check_bool("per_layer", per_layer)
        self.clip_fraction = _base.check_bool("clip_fraction", clip_fraction)
        self.update_ratio = _base.check_bool("update_ratio", update_ratio)
        self.adaptive_fraction = _base.check_bool("adaptive_fraction", adaptive_fraction)
        self.tensorboard_dir = _base.check_optional_path("tensorboard_dir", tensorboard_dir)
        self.histogram_freq = _base.check_int(
            "histogram_freq",
            histogram_freq,
            0,
            " (epochs between weight histograms; 0 for none)",
        )
        if self.histogram_freq and self.tensorboard_dir is None:
            raise ValueError(
                "`histogram_freq` needs `tensorboard_dir`: histograms are "
                "written to TensorBoard. Received: "
                f"histogram_freq={histogram_freq}, tensorboard_dir=None. Fix: "
                "pass `tensorboard_dir=...` or `histogram_freq=0`."
            )
        if isinstance(update_freq, str):
            update_freq = _base.check_choice("update_freq", update_freq, ("epoch", "batch"))
        else:
            update_freq = _base.check_int("update_freq", update_freq, 1, ' or "epoch" or "batch"')
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._writer = None

    # ---------------------------------------------------------------- model
    def required_telemetry(self, model):
        keys = ["grad_norm"]
        if self.per_layer:
            keys += model.layer_norm_keys()
        if self.clip_fraction:
            keys += ["clipped_updates", "updates"]
        if self.update_ratio:
            keys.append("update_ratio")
        if self.adaptive_fraction:
            keys.append(AGC_CLIPPED_FRACTION)
        return keys

    def check_model(self, model):
        if self.clip_fraction and model.clip_norm is None:
            raise ValueError(
                "`clip_fraction=True` needs a model that clips, but the "
                "model has clip_norm=None. Fix: build it with "
                "`FastGradModel(..., clip_norm=...)`, or pass "
                "`clip_fraction=False`."
            )
        if self.adaptive_fraction and model.clip_adaptive is None:
            raise ValueError(
                "`adaptive_fraction=True` needs a model that clips "
                "adaptively, but the model has clip_adaptive=None. Fix: "
                "build it with `FastGradModel(..., clip_adaptive=...)`, or "
                "pass `adaptive_fraction=False`."
            )

    def _logged_keys(self):
        """The keys this callback puts in the logs (and in TensorBoard)."""
        keys = self.required_telemetry(self.model)
        keys = [k for k in keys if k not in ("clipped_updates", "updates")]
        return keys + [CLIPPED_FRACTION] if self.clip_fraction else keys

    # ------------------------------------------------------------- training
    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._epoch_start = self.model.telemetry_counters()
        self._keys = self._logged_keys()
        self._batches_before_epoch = self._last_written = self._step = 0
        if self.tensorboard_dir is not None:
            self._writer = SummaryWriter(self.tensorboard_dir)

    def on_train_batch_end(self, batch, logs=None):
        if logs is None:
            return
        self._add_clipped_fraction(logs)
        batch = compat.last_batch(self.model, batch)
        steps = self.params.get("steps") if self.params else None
        if steps:  # the last call of a `steps_per_execution` group may be short
            batch = min(batch, steps - 1)
        step = self._batches_before_epoch + batch + 1
        if self._writer is not None and self.update_freq != "epoch":
            if step - self._last_written >= self.update_freq:
                self._writer.scalars(self._present(logs), step, "batch_")
                self._last_written = step
        self._step = step

    def on_epoch_end(self, epoch, logs=None):
        self._batches_before_epoch = self._step
        if logs is None:
            return
        self._add_clipped_fraction(logs)
        if self.clip_fraction:
            self._epoch_start = {k: logs.get(k, 0.0) for k in self._epoch_start}
        if self._writer is not None:
            self._writer.scalars(self._present(logs), epoch, "epoch_")
            if self.histogram_freq and (epoch + 1) % self.histogram_freq == 0:
                self._writer.histograms(self.model.trainable_weights, epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        super().on_train_end(logs)

    def _add_clipped_fraction(self, logs):
        if not self.clip_fraction or "updates" not in logs:
            return
        updates = logs["updates"] - self._epoch_start["updates"]
        clipped = logs["clipped_updates"] - self._epoch_start["clipped_updates"]
        logs[CLIPPED_FRACTION] = clipped / updates if updates > 0 else 0.0

    def _present(self, logs):
        """The logged values this callback writes: its keys, and on a
        multi-task model the step's task keys (`task_grad_norm/<task>`,
        `task_cosine/<a>/<b>`, `task_conflicts`)."""
        return {k: v for k, v in logs.items() if k in self._keys or is_task_key(k)}
