"""Shared base of the FastGradModel callbacks: checks the model they are
attached to, asks its step for the telemetry keys they read, and holds the
argument checks they share (Keras-style messages)."""

import functools

import keras

# The argument checks the callbacks share live with the model's.
from keras_fastgrad._validation import (  # noqa: F401
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_path,
)


class FastGradCallback(keras.callbacks.Callback):
    """Base class of the callbacks that read `FastGradModel`'s telemetry.

    Subclasses list the step's log keys they need in `telemetry_keys`, or
    override `required_telemetry(model)` when the keys depend on the model
    (e.g. one `grad_norm/<layer>` key per layer), and read them from the
    `logs` of `on_train_batch_end` / `on_epoch_end`. Keras calls
    `set_model` before it builds the train function, so the step is traced
    with the keys already switched on. Counters in the logs are cumulative
    over the model's life: difference them between calls.

    Attached to the `fit` of a plain Keras model (`keras.Model`,
    `keras.Sequential`, a KerasHub task), the callback gives that `fit`
    `FastGradModel`'s step with options that train exactly like
    `keras.Model` (no accumulation, clipping or skipping), so the step can
    measure; the model is itself again after `fit`, also when `fit` raises
    (it is a `FastGradModel` only while the step and the callbacks' hooks
    run: `keras_fastgrad.models.attachment.attach`). Subclasses that override
    `on_train_begin` / `on_train_end` call `super()`; their `on_*` hooks
    see the model as a `FastGradModel`.

    Raises:
        ValueError: from `set_model` (at the start of `fit`) when the
            model's class overrides `train_step` (there is no step of ours
            to measure in), or when `check_model` refuses the model; when
            `fit` traces the step of a `FastGradModel` subclass whose own
            `train_step` never calls `FastGradModel.train_step` (no step of
            ours to measure in either).

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> class UpdatesPerEpoch(keras_fastgrad.callbacks.FastGradCallback):
    ...     telemetry_keys = ("updates",)
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         print(f"epoch {epoch}: {logs['updates']:.0f} updates so far")
    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2,
    ...                     epochs=2, verbose=0, callbacks=[UpdatesPerEpoch()])
    epoch 0: 2 updates so far
    epoch 1: 4 updates so far
    """

    telemetry_keys = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A plain model is a `FastGradModel` only while our code runs: each
        # hook a subclass defines sees it as one (`attachment.stepping`).
        for name, hook in list(vars(cls).items()):
            if name.startswith("on_") and callable(hook):
                setattr(cls, name, _seeing_the_step(hook))

    def required_telemetry(self, model):
        """The telemetry keys this callback reads from `model`'s logs."""
        return self.telemetry_keys

    def set_model(self, model):
        from keras_fastgrad import backend
        from keras_fastgrad.models import attachment

        backend.check_callback(self, model)  # on JAX: refused, by name

        # A plain Keras model gets the step for this `fit` (`attachment.attach`:
        # default options, exactly `keras.Model`'s updates), until
        # `on_train_end`.
        self._attached = attachment.attach(model)
        self._fitting = False
        super().set_model(model)
        try:
            with attachment.stepping(model):
                self.check_model(model)
                model.enable_telemetry(self.required_telemetry(model))
        except Exception:
            attachment.detach(model)  # refused: the model stays as it was
            self._attached = False
            raise

    def on_train_begin(self, logs=None):
        self._fitting = True

    def on_train_batch_begin(self, batch, logs=None):
        from keras_fastgrad.models import attachment

        attachment.prepare_call(self.model)  # the step runs for this `fit`

    def on_train_end(self, logs=None):
        self._fitting = False
        self._detach()

    def on_test_end(self, logs=None):
        if not self._fitting:  # `evaluate` on its own, not inside `fit`
            self._detach()

    def on_predict_end(self, logs=None):
        self._detach()

    def _detach(self):
        from keras_fastgrad.models import attachment

        if getattr(self, "_attached", False):
            self._attached = False
            attachment.detach(self.model)

    def check_model(self, model):
        """Hook: raise if this callback's settings do not fit `model`."""


def _seeing_the_step(hook):
    """`hook`, run with an attached plain model seen as a `FastGradModel`
    (and, for `on_train_batch_begin`, announcing the train function's next
    call, as the base class's hook does)."""
    announces = hook.__name__ == "on_train_batch_begin"

    @functools.wraps(hook)
    def seeing_the_step(self, *args, **kwargs):
        from keras_fastgrad.models import attachment

        if announces:
            attachment.prepare_call(self.model)
        with attachment.stepping(self.model):
            return hook(self, *args, **kwargs)

    return seeing_the_step
