"""Argument checks shared by the models, callbacks and profiling, run once
in Python before anything is traced.

Every message follows the Keras recipe: the argument in backticks, the rule,
the value received and, where there is one, the fix.
"""

import numbers
import os


def check_bool(name, value):
    """Returns `value` as a Python bool if it is a Python or numpy bool.

    Integers (even 0 and 1) and strings are refused: `"False"` is truthy.
    """
    import numpy as np  # only this check needs numpy

    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"`{name}` must be a boolean (True or False). Received: "
            f"{name}={value!r} of type {type(value).__name__}."
        )
    return bool(value)


def check_int(name, value, minimum, what=""):
    """An integer >= `minimum` (bools refused); `what` explains the value."""
    rule = f"`{name}` must be an integer >= {minimum}{what}."
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{rule} Received: {name}={value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{rule} Received: {name}={value!r}")
    return int(value)


def check_optional_int(name, value, minimum, what=""):
    """`None` or an integer >= `minimum` (see `check_int`)."""
    return None if value is None else check_int(name, value, minimum, what)


def check_choice(name, value, choices):
    """A string among `choices`."""
    rule = f"`{name}` must be one of {list(choices)}."
    if not isinstance(value, str):
        raise TypeError(f"{rule} Received: {name}={value!r} of type {type(value).__name__}.")
    if value not in choices:
        raise ValueError(f"{rule} Received: {name}={value!r}")
    return value


def check_optional_path(name, value):
    """A directory path (str or path-like) or None."""
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.fspath(value)
    raise TypeError(
        f"`{name}` must be a directory path (str or path-like) or None. "
        f"Received: {name}={value!r} of type {type(value).__name__}."
    )


def check_number(name, value, minimum=0.0, maximum=None, open_min=False):
    """`value` as a float in `[minimum, maximum]` (`(minimum, ...` if open)."""
    low = f"> {minimum}" if open_min else f">= {minimum}"
    rule = low if maximum is None else f"{low} and <= {maximum}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > minimum if open_min else value >= minimum)
    ok = ok and (maximum is None or value <= maximum)
    if not ok:
        raise ValueError(f"`{name}` must be a number {rule}. Received: {name}={value!r}")
    return float(value)


def check_ran_once(calls, layer_name):
    """`multitask_features` names a layer that ran at most once in this
    forward pass (`calls`: its calls so far; the captures of
    `multitask.representation` and, on JAX, `backend.jax_features`)."""
    if calls > 1:
        raise ValueError(
            "`multitask_features` must name a layer that runs once per "
            f"forward pass. Received: multitask_features={layer_name!r}"
            ", which ran more than once. Fix: name the layer whose single "
            "output all tasks read."
        )
