"""Argument checks, run once in Python before anything is traced.

Every message follows the Keras recipe: the argument in backticks, the rule,
the value received and, where there is one, the fix.
"""

import numbers

from keras_fastgrad import aggregators

MULTITASK_NAMES = aggregators.NAMES


def check_accumulation_steps(value):
    """Returns `value` if it is an integer >= 1, else raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "`accumulation_steps` must be an integer >= 1 (the number of "
            "batches per optimizer update). Received: "
            f"accumulation_steps={value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(
            "`accumulation_steps` must be an integer >= 1 (the number of "
            f"batches per optimizer update). Received: accumulation_steps={value}"
        )
    return int(value)


def check_clip_norm(value):
    """Returns `value` as a float if it is None or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "`clip_norm` must be a number > 0 (the maximum global L2 norm "
            "of each update's gradient) or None. Received: "
            f"clip_norm={value!r} of type {type(value).__name__}."
        )
    if not value > 0 or value == float("inf"):
        raise ValueError(
            "`clip_norm` must be a finite number > 0 or None (to disable "
            f"clipping). Received: clip_norm={value!r}"
        )
    return float(value)


def check_multitask(value):
    """Returns `None` or the `Aggregator` for a multi-task method.

    Accepts `None`, a name from `MULTITASK_NAMES`, an
    `keras_fastgrad.aggregators.Aggregator` instance or its config dict (as
    `get_config` writes it).
    """
    if value is None:
        return None
    if isinstance(value, aggregators.Aggregator) or isinstance(value, dict):
        return aggregators.get(value)
    if isinstance(value, str) and value.lower() in MULTITASK_NAMES:
        return aggregators.get(value)
    raise ValueError(
        f"`multitask` must be None or one of {list(MULTITASK_NAMES)}. "
        f"Received: multitask={value!r}. A custom method is an instance of "
        "`keras_fastgrad.aggregators.Aggregator`."
    )


def check_bool(name, value):
    """Returns `value` if it is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a boolean (True or False). Received: "
            f"{name}={value!r} of type {type(value).__name__}."
        )
    return value


def check_optimizer_ownership(optimizer, accumulation_steps, clip_norm):
    """Refuses a concern owned twice: by the model and by the optimizer.

    Args:
        optimizer: The compiled optimizer (possibly a `LossScaleOptimizer`).
        accumulation_steps: The model's `accumulation_steps`.
        clip_norm: The model's `clip_norm`.

    Raises:
        ValueError: if the optimizer accumulates while the model does, or
            clips while the model does.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    optimizer_steps = getattr(inner, "gradient_accumulation_steps", None)
    if accumulation_steps > 1 and optimizer_steps:
        raise ValueError(
            "Gradient accumulation is set twice: "
            f"`FastGradModel(accumulation_steps={accumulation_steps})` and "
            f"the optimizer's `gradient_accumulation_steps={optimizer_steps}`. "
            "Only one may own it. Fix: remove `gradient_accumulation_steps` "
            "from the optimizer (the model's accumulation is exact for "
            "uneven batches and sample weights), or use "
            "`accumulation_steps=1`."
        )
    if clip_norm is not None:
        for attr in ("clipnorm", "global_clipnorm", "clipvalue"):
            optimizer_value = getattr(inner, attr, None)
            if optimizer_value is not None:
                raise ValueError(
                    "Gradient clipping is set twice: "
                    f"`FastGradModel(clip_norm={clip_norm})` and the "
                    f"optimizer's `{attr}={optimizer_value}`. Only one may "
                    f"own it. Fix: remove `{attr}` from the optimizer (the "
                    "model clips the final gradient of each update once, "
                    "after accumulation), or use `clip_norm=None`."
                )
