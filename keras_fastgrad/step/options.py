"""`StepOptions`: what the step's units read of the model's options.

The model hands its checked constructor options to its `StepState` once,
when they are set (`FastGradModel.__init__`, `from_config`, `fastgrad`):
`state.options`. A unit that reads an option reads it there, so it needs
the model only for what only the model has (its call, its compiled loss
and metrics, its variables and layers).
"""

import collections

import keras

# The constructor's options (`FastGradModel.__init__`), in its order.
NAMES = (
    "accumulation_steps",
    "clip_norm",
    "clip_adaptive",
    "clip_adaptive_eps",
    "multitask",
    "skip_nonfinite",
    "telemetry",
    "micro_batches",
    "max_consecutive_nonfinite",
    "multitask_space",
    "multitask_features",
    "batchnorm_statistics",
)


class StepOptions(collections.namedtuple("StepOptions", [*NAMES, "keras_metrics"])):
    """The model's options as the step reads them (immutable).

    Fields: the constructor's options (`FastGradModel`'s Args, checked),
    and `keras_metrics`: whether the model's class computes its metrics
    as `keras.Model` does (no `compute_metrics` of its own: the step may
    update them inside its update's `cond`).

    Example:

    >>> import keras_fastgrad
    >>> inputs = keras.Input((3,))
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1)(inputs), clip_norm=1.0)
    >>> options = model.fastgrad_step_state.options
    >>> options.clip_norm, options.accumulation_steps, options.keras_metrics
    (1.0, 1, True)
    """

    @classmethod
    def of(cls, model_class, options):
        """The options of a model of `model_class`, from `options` (a
        dict of every constructor option, checked, by name)."""
        if set(options) != set(NAMES):
            raise ValueError(
                f"`options` must name every option of FastGradModel {list(NAMES)}. "
                f"Received: {sorted(options)}."
            )
        keras_metrics = model_class.compute_metrics is keras.Model.compute_metrics
        return cls(**options, keras_metrics=keras_metrics)

    def combining(self):
        """The options that combine micro-batches into one update, as set
        (`compile_loss.check_extra_terms`' messages, on both backends);
        replicas do not count (Keras itself combines those).

        Example:

        >>> import keras_fastgrad
        >>> inputs = keras.Input((3,))
        >>> model = keras_fastgrad.FastGradModel(
        ...     inputs, keras.layers.Dense(1)(inputs), accumulation_steps=4)
        >>> model.fastgrad_step_state.options.combining()
        ['accumulation_steps=4']
        """
        names = ("accumulation_steps", "micro_batches")
        return [f"{name}={getattr(self, name)}" for name in names if getattr(self, name) > 1]
