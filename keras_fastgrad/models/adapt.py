"""`fastgrad(model)`: `FastGradModel`'s train step for a model you have.

A model built elsewhere (`keras.applications`, a KerasHub task, a plain
functional `keras.Model`, `keras.Sequential`, your own `keras.Model`
subclass) gets the step in place: its class becomes a subclass of both
`FastGradModel` and its own class (`models/step_classes.py`), so its
methods keep working and its weights stay where they are. The callbacks
give a plain model the step for one `fit` only (`models/attachment.py`).
"""

import difflib

from keras_fastgrad import aggregators
from keras_fastgrad.models import attachment, step_classes
from keras_fastgrad.models.model import (
    OPTION_NAMES,
    FastGradModel,
    _checked_options,
)
from keras_fastgrad.models.options import check_compiled


def fastgrad(model, **options):
    """Gives an existing Keras model `FastGradModel`'s train step, in place.

    The model keeps its class (it becomes an instance of a subclass of both
    `FastGradModel` and its own class), its weights, optimizer and compile
    settings; `fit` then runs `FastGradModel`'s step with these options
    (with none, it trains exactly as before). Saved to `.keras`, it loads
    back with the step and its options.

    Args:
        model: A `keras.Model` (functional, `keras.Sequential`, a
            `keras.applications` or KerasHub model, a subclass) whose class
            does not override `train_step`.
        **options: `FastGradModel`'s options (`accumulation_steps`,
            `clip_norm`, `clip_adaptive`, `clip_adaptive_eps`, `multitask`,
            `multitask_space`,
            `multitask_features`, `skip_nonfinite`, `micro_batches`,
            `max_consecutive_nonfinite`, `telemetry`, `batchnorm_statistics`).

    Returns:
        `model` itself, now also a `FastGradModel`.

    Raises:
        TypeError: if `model` is not a `keras.Model`, or for an unknown
            option name.
        ValueError: if the model's class overrides `train_step` (its own
            step would silently stop running), for an invalid option value,
            for an option the compiled optimizer already owns
            (`gradient_accumulation_steps`, `clipnorm`, ...), for
            `multitask` on a compiled model with fewer than two task
            losses, or for different options on a model that already is a
            `FastGradModel`. A refusal leaves the model as it was.

    Example:

    >>> inputs = keras.Input((3,))
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    >>> model = fastgrad(model, accumulation_steps=2)
    >>> isinstance(model, keras_fastgrad.FastGradModel)
    True
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=2,
    ...                     verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
    """
    step_classes.check_model(model)
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        fix = f" Fix: did you mean `{close[0]}`?" if close else ""
        raise TypeError(
            f"`fastgrad` got unknown option(s) {unknown}. Options are "
            f"{list(OPTION_NAMES)} (see `FastGradModel`).{fix}"
        )
    if isinstance(model, FastGradModel):
        # Compared as saved (an aggregator by its config, not its identity).
        current = model._fg_options()
        proposed = _checked_options(**{**current, **options})
        if proposed["multitask"] is not None:
            proposed["multitask"] = aggregators.serialize(proposed["multitask"])
        changed = {k: v for k, v in proposed.items() if v != current[k]}
        if changed:
            raise ValueError(
                "`model` already is a `FastGradModel`; its options are set "
                f"when it is built. Received: {changed} (the model has "
                f"{ {k: current[k] for k in changed} }). Fix: build it with "
                "these options, or call `fastgrad` on the plain model."
            )
        return model
    # Everything checked before anything changes: a refusal leaves the
    # model as it was (class, config, step).
    checked = _checked_options(**options)
    if model.compiled:
        check_compiled(model, checked)
    attachment.detach(model)  # what a `fit` with our callbacks that raised left
    _give_step(model, checked)
    if model.compiled:
        model._fg_after_compile()
    return model


def _give_step(model, options):
    model.__class__ = step_classes.step_class(type(model))
    model._fg_setup(options)
    model.train_function = None  # traced again, with the step
