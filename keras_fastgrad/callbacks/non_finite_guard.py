"""`NonFiniteGuard`: acts on NaN/Inf found by the step's finite check, and
says where it was."""

import warnings

from keras_fastgrad import _compat as compat
from keras_fastgrad.callbacks import _base, _progress_bar

ACTIONS = ("raise", "stop", "warn")


class NonFiniteError(RuntimeError):
    """Raised by `NonFiniteGuard(action="raise")` on a NaN/Inf micro-batch.

    A micro-batch's loss or gradient held NaN/Inf. The message names the
    epoch, the batch(es) and the first variable whose gradient was
    non-finite (or the loss).

    Example:

    >>> import keras_fastgrad
    >>> issubclass(keras_fastgrad.callbacks.NonFiniteError, RuntimeError)
    True
    """


class NonFiniteGuard(_base.FastGradCallback):
    """Raises, stops or warns when the train step meets NaN/Inf.

    `FastGradModel` checks every micro-batch's loss and gradients inside the
    compiled step (a plain `is_finite` reduction, so it also works under
    `jit_compile=True`, where `tf.debugging.check_numerics` does nothing),
    drops a non-finite micro-batch and counts it. This callback compares
    the cumulative count between calls, so a NaN in any step of a
    `steps_per_execution` group is noticed, and reports where it was: the
    path of the first variable (in `model.trainable_variables`) whose
    gradient was non-finite and how many were, or the loss when every
    gradient was finite, plus the epoch and batch (0-based, as Keras passes
    them to callbacks). Under
    `steps_per_execution > 1` the batch is known to the group (e.g.
    "batches 0-3"), and when several micro-batches went bad in one call the
    location is that of the latest.

    Its log keys (`nonfinite_count`, cumulative over the model's life;
    `nonfinite_first_index` and `nonfinite_num_variables`, where the most
    recent non-finite micro-batch went bad, -1 and 0 until one does) reach
    `History` and every callback, each batch and epoch; `fit`'s progress
    bar leaves them out until the `fit` meets a non-finite micro-batch,
    and shows them from then on.

    With dynamic loss scaling (`mixed_float16`), overflowing gradients are
    non-finite too and expected now and then: prefer `action="warn"` there.

    Args:
        action: `"raise"` (default): raise `NonFiniteError`. `"stop"`: set
            `model.stop_training = True`, so `fit` ends cleanly after the
            current batch (the epoch still ends and is logged). `"warn"`:
            go on (the model already dropped the micro-batch, unless it has
            `skip_nonfinite=False`) and issue at most one `RuntimeWarning`
            per epoch, at its end: how many micro-batches went bad in that
            epoch, and the report of the latest (as `"raise"` words it).

    Raises:
        NonFiniteError: during `fit` with `action="raise"`.
        TypeError, ValueError: for an invalid `action`; at `fit`,
            `ValueError` when the model is not a `FastGradModel`.

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1, name="head")(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x = np.ones((4, 2)); x[2, 0] = np.nan
    >>> guard = keras_fastgrad.callbacks.NonFiniteGuard(action="raise")
    >>> try:
    ...     model.fit(x, np.ones((4, 1)), batch_size=2, shuffle=False,
    ...               verbose=0, callbacks=[guard])
    ... except keras_fastgrad.callbacks.NonFiniteError as error:
    ...     print(error)
    Non-finite gradient in epoch 0, batch 1 (0-based): 1 micro-batch(es) ... first non-finite gradient: `head/kernel` (2 of 2 gradients non-finite).

    With `action="warn"`, one summary per epoch however many batches failed:

    >>> import warnings
    >>> x[0, 1] = np.nan  # batches 0 and 1 of each epoch go bad
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = model.fit(x, np.ones((4, 1)), batch_size=2, epochs=2,
    ...                   shuffle=False, verbose=0,
    ...                   callbacks=[keras_fastgrad.callbacks.NonFiniteGuard("warn")])
    >>> for w in caught:
    ...     if issubclass(w.category, RuntimeWarning):
    ...         print(str(w.message)[:74])
    Epoch 0: 2 non-finite micro-batch(es) dropped in this epoch. The latest: N
    Epoch 1: 2 non-finite micro-batch(es) dropped in this epoch. The latest: N
    """

    telemetry_keys = (
        "nonfinite_count",
        "nonfinite_first_index",
        "nonfinite_num_variables",
    )

    def __init__(self, action="raise"):
        super().__init__()
        self.action = _base.check_choice("action", action, ACTIONS)
        self._count_at_start = None  # the model's count when this `fit` began
        self._show_again = None

    def set_model(self, model):
        super().set_model(model)
        self._stop_hiding()  # a bar of an earlier call that never reached its end
        self._show_again = _progress_bar.hide_keys(self._quiet_keys)

    def _quiet_keys(self, logs):
        """The keys `fit`'s progress bar leaves out of `logs`: all of ours
        while this `fit` has met nothing non-finite (their values are
        sentinels then); none once it has."""
        count = logs.get("nonfinite_count")
        if self._count_at_start is None or count is None or count > self._count_at_start:
            return ()
        return self.telemetry_keys

    def _stop_hiding(self):
        if self._show_again is not None:
            self._show_again()
            self._show_again = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._seen = self.model.telemetry_counters()["nonfinite_count"]
        self._count_at_start = self._seen
        # Read now: a plain model's step may be detached before this
        # callback's `on_train_end` writes its last summary.
        self._skip_nonfinite = self.model.skip_nonfinite
        self._epoch = self._begin = 0
        self._pending, self._latest = 0, None  # warn: count and latest report this epoch

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._pending, self._latest = 0, None

    def on_epoch_end(self, epoch, logs=None):
        self._warn_summary()

    def on_train_end(self, logs=None):
        self._warn_summary()  # an epoch cut short without `on_epoch_end`
        self._stop_hiding()
        self._count_at_start = None
        super().on_train_end(logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        batch = compat.last_batch(self.model, batch)
        count = (logs or {}).get("nonfinite_count")
        if count is None or count <= self._seen:
            return
        new, self._seen = count - self._seen, count
        message = self._describe(int(new), batch, logs)
        if self.action == "raise":
            raise NonFiniteError(message)
        if self.action == "warn":  # summarised once, at the end of the epoch
            self._pending += int(new)
            self._latest = message
            return
        self.model.stop_training = True  # action="stop"
        message += " Stopping training (action='stop')."
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _warn_summary(self):
        if not self._pending:
            return
        summary = (
            f"Epoch {self._epoch}: {self._pending} non-finite micro-batch(es) "
            f"{self._fate()} in this epoch. The latest: {self._latest}"
        )
        self._pending, self._latest = 0, None
        warnings.warn(summary, RuntimeWarning, stacklevel=2)

    def _fate(self):
        if self._skip_nonfinite:
            return "dropped"
        return "APPLIED (skip_nonfinite=False)"

    def _describe(self, new, batch, logs):
        steps = self.params.get("steps") if self.params else None
        if steps:  # a `steps_per_execution` group may be cut short
            batch = min(batch, steps - 1)
        where = f"batch {batch}" if batch == self._begin else f"batches {self._begin}-{batch}"
        index = int(logs.get("nonfinite_first_index", -1))
        if index < 0:
            kind, what = "loss", "the loss was NaN/Inf, every gradient finite."
        else:
            variables = self.model.trainable_variables
            name = variables[index].path if index < len(variables) else f"#{index}"
            total = int(logs.get("tape_variables", len(variables)))
            kind = "gradient"
            what = (
                f"first non-finite gradient: `{name}` "
                f"({int(logs.get('nonfinite_num_variables', 1))} of {total} "
                "gradients non-finite)."
            )
        return (
            f"Non-finite {kind} in epoch {self._epoch}, {where} (0-based): {new} "
            f"micro-batch(es) {self._fate()}; in the latest, {what}"
        )
