"""`TapeVariableCounter`: how many variables the step's tape watched, and
which trainable ones got no gradient."""

import warnings

from keras_fastgrad.callbacks import _base

TRAINABLE_VARIABLES = "trainable_variables"


class TapeVariableCounter(_base.FastGradCallback):
    """Logs how many variables the train step's gradient tape watched.

    `FastGradModel`'s tape watches exactly the model's trainable variables
    (`watch_accessed_variables=False`, then one `watch` per trainable
    variable), so frozen layers and non-trainable state (BatchNorm moving
    statistics, counters) cost nothing in the backward pass. This callback
    logs `tape_variables` (a fact of the traced step, not a per-step value)
    and `trainable_variables` (the count of `model.trainable_variables`
    now), and warns once, by name:

    - about trainable variables that received no gradient in the traced
      step (unused by the loss, or cut off by `stop_gradient`): they are
      never updated;
    - when the tape watched a different number of variables than the model
      has trainable ones, i.e. trainable flags changed after the step was
      traced (`layer.trainable = False` without a new `compile`): the step
      still trains or ignores the variables it was traced with. Freezing a
      layer changes the counts once you recompile.

    On Keras' JAX backend there is no tape: `tape_variables` is the number
    of trainable variables the gradient (`jax.value_and_grad`) is taken
    for, all of them. JAX gives a variable the loss does not reach a zero
    gradient (TensorFlow's tape: `None`); the traced step finds such
    variables from its program while this callback is attached (one more
    trace of the forward pass), and the same warning names them. Changing
    `trainable` without a new `compile` is an error on JAX (as for
    `keras.Model`: the optimizer was built for the variables it had), not
    a warning.

    Raises:
        ValueError: at `fit`, when the model is not a `FastGradModel`.

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> inputs = keras.Input((3,))
    >>> hidden = keras.layers.Dense(4, name="body")(inputs)
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1, name="head")(hidden))
    >>> model.get_layer("body").trainable = False
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0,
    ...     callbacks=[keras_fastgrad.callbacks.TapeVariableCounter()])
    >>> history.history["tape_variables"], history.history["trainable_variables"]
    ([2.0], [2.0])
    """

    telemetry_keys = ("tape_variables",)

    def __init__(self):
        super().__init__()
        self._warned = set()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # A model unbuilt when `fit` starts (a subclass, on TensorFlow)
        # has its variables once the step is built: counted then.
        self._count = float(len(self.model.trainable_variables)) if self.model.built else None
        self._checked = False

    def on_train_batch_end(self, batch, logs=None):
        if self._count is None:  # the step has been traced by now
            self._count = float(len(self.model.trainable_variables))
        if logs is None:
            return
        logs[TRAINABLE_VARIABLES] = self._count
        if not self._checked:  # the step has been traced by now
            self._checked = True
            self._check(logs.get("tape_variables"))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._count is not None:
            logs[TRAINABLE_VARIABLES] = self._count

    def _check(self, watched):
        model = self.model
        missing = model.variables_without_gradient or []
        if missing:
            self._warn_once(
                f"TapeVariableCounter: {len(missing)} trainable variable(s) "
                f"received no gradient and are never updated: {missing}. "
                "They do not reach the loss (unused, or behind "
                "`stop_gradient`). Fix: use them, or set `trainable=False` "
                "on their layer and recompile."
            )
        if watched is not None and int(watched) != int(self._count):
            frozen = [l.name for l in model.layers if l.weights and not l.trainable]
            self._warn_once(
                f"TapeVariableCounter: the train step's tape watched "
                f"{int(watched)} variables but the model now has "
                f"{int(self._count)} trainable ones: trainable flags changed "
                "after the step was traced, so it still trains the "
                "variables it was traced with (frozen layers now: "
                f"{frozen}). Fix: call `model.compile(...)` again after "
                "changing `trainable`."
            )

    def _warn_once(self, message):
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=3)
