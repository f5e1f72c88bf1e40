"""`FastGradModel`'s constructor options, checked once in Python before
anything is traced: each value, the combinations refused, an unknown
keyword, and (`checked_options`) what the backend's step does not
implement. How the options meet the compiled model (its optimizer, its
losses) is `keras_fastgrad.step.compile_checks`'; what a `tf.distribute`
strategy refuses is `keras_fastgrad.step.trainer.check_strategy`.

Every message follows the Keras recipe: the argument in backticks, the rule,
the value received and, where there is one, the fix. The generic checks
(booleans, integers, choices) live in `keras_fastgrad._validation`.
"""

import difflib
import numbers

import numpy as np

from keras_fastgrad import aggregators
from keras_fastgrad._validation import check_bool, check_choice, check_int, check_optional_int
from keras_fastgrad.step.adaptive_clipping import DEFAULT_EPSILON as DEFAULT_AGC_EPSILON
from keras_fastgrad.step.batchnorm import CHOICES as BATCHNORM_CHOICES


def check_accumulation_steps(value):
    """Returns `value` if it is an integer >= 1, else raises."""
    return check_int(
        "accumulation_steps", value, 1, " (the number of batches per optimizer update)"
    )


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


def _check_positive_finite(name, value, meaning, off=""):
    """Returns `value` as a float if it is a finite number > 0, else raises
    (`off`: how to switch the option off, for the message)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a finite number > 0 ({meaning}){off}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not 0 < value < float("inf"):
        raise ValueError(
            f"`{name}` must be a finite number > 0 ({meaning}){off}. "
            f"Received: {name}={value!r}. Fix: pass a value such as "
            f"{_EXAMPLES[name]}."
        )
    return float(value)


_EXAMPLES = {"clip_adaptive": "0.01 (the paper's for large batches)", "clip_adaptive_eps": "1e-3"}


def check_clip_adaptive(value, eps):
    """`clip_adaptive` (None, or lambda: a finite number > 0) and
    `clip_adaptive_eps` (a finite number > 0, only meaningful with it).

    Returns:
        A dict with both options, as floats (`clip_adaptive` may be None).
    """
    eps = _check_positive_finite(
        "clip_adaptive_eps", eps, "the smallest weight norm a unit is measured by"
    )
    if value is None:
        if eps != DEFAULT_AGC_EPSILON:
            raise ValueError(
                "`clip_adaptive_eps` is used only by adaptive gradient "
                "clipping, which is off. Received: clip_adaptive=None, "
                f"clip_adaptive_eps={eps!r}. Fix: pass `clip_adaptive=...` "
                "(e.g. 0.01) too, or leave `clip_adaptive_eps` at its default."
            )
        return {"clip_adaptive": None, "clip_adaptive_eps": eps}
    value = _check_positive_finite(
        "clip_adaptive",
        value,
        "the largest ratio of a unit's gradient norm to its weight norm",
        " or None (no adaptive clipping)",
    )
    if not float(np.float32(value) * np.float32(eps)) >= np.finfo(np.float32).tiny:
        raise ValueError(
            "`clip_adaptive * clip_adaptive_eps` (the smallest norm a unit "
            "may keep) must be a normal float32 (>= 1.2e-38): a smaller one "
            "rounds to 0, and every unit's gradient to 0 or NaN. Received: "
            f"clip_adaptive={value!r}, clip_adaptive_eps={eps!r}. Fix: larger "
            "values (the paper uses clip_adaptive=0.01 with eps=1e-3)."
        )
    return {"clip_adaptive": value, "clip_adaptive_eps": eps}


def check_multitask(value):
    """Returns `None` or the `Aggregator` for a multi-task method.

    Accepts `None`, a name from `aggregators.NAMES`, an
    `keras_fastgrad.aggregators.Aggregator` instance or its config dict (as
    `get_config` writes it).
    """
    if value is None:
        return None
    if isinstance(value, aggregators.Aggregator) or isinstance(value, dict):
        return aggregators.get(value)
    if isinstance(value, str) and value.lower() in aggregators.NAMES:
        return aggregators.get(value)
    raise ValueError(
        f"`multitask` must be None or one of {list(aggregators.NAMES)}. "
        f"Received: multitask={value!r}. A custom method is an instance of "
        "`keras_fastgrad.aggregators.Aggregator`."
    )


# Where a multi-task method compares the tasks (`keras_fastgrad.multitask`).
MULTITASK_SPACES = ("parameters", "features")


def check_multitask_space(space, features, multitask):
    """`multitask_space` and `multitask_features`, checked together.

    Returns:
        A dict with both options.
    """
    space = check_choice("multitask_space", space, MULTITASK_SPACES)
    if features is not None and not isinstance(features, str):
        raise TypeError(
            "`multitask_features` must be None or a layer name (a string). "
            f"Received: multitask_features={features!r} of type "
            f"{type(features).__name__}."
        )
    if features is not None and not features.strip():
        raise ValueError(
            "`multitask_features` must be None or a layer name (a non-empty "
            f"string). Received: multitask_features={features!r}. Fix: pass "
            "the name of the layer whose output is the shared "
            "representation, or None to find it in a functional model."
        )
    if space == "features" and multitask is None:
        raise ValueError(
            '`multitask_space="features"` needs a multi-task method. '
            'Received: multitask=None, multitask_space="features". Fix: '
            'pass `multitask="pcgrad"` (or another method), or leave '
            '`multitask_space` at "parameters".'
        )
    if features is not None and space != "features":
        raise ValueError(
            "`multitask_features` names the shared representation of "
            '`multitask_space="features"`. Received: '
            f"multitask_features={features!r}, multitask_space={space!r}. "
            'Fix: pass `multitask_space="features"`, or drop '
            "`multitask_features`."
        )
    return {"multitask_space": space, "multitask_features": features}


def check_keyword_names(kwargs, option_names, keras_names, owner="FastGradModel"):
    """Refuses a keyword that is neither one of `FastGradModel`'s options
    nor one `keras.Model` accepts (Keras' functional form would silently
    ignore it), suggesting the closest valid name.

    Raises:
        TypeError: for an unknown keyword.
    """
    unknown = sorted(set(kwargs) - set(option_names) - set(keras_names))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, [*option_names, *keras_names], n=1)
    fix = (
        f"Fix: did you mean `{close[0]}`?"
        if close
        else f"Fix: use one of the options {list(option_names)}."
    )
    raise TypeError(
        f"`{name}` is not an argument of `{owner}` (its options are "
        f"{list(option_names)}; the other keywords go to `keras.Model`: "
        f"{list(keras_names)}). Received: {name}={kwargs[name]!r}. {fix}"
    )


def checked_options(options, defaults, backend_check):
    """The constructor's options: `defaults` for those not in `options`,
    validated by `check_option_values`, then by the backend's shell (what its
    step does not implement).

    Args:
        options: Dict of the options given, by name.
        defaults: Dict of every option's default value (read off
            `FastGradModel.__init__`'s signature).
        backend_check: Callable `(options, defaults)` raising for an
            option the backend's step does not implement
            (`keras_fastgrad.backend.check_options`).

    Returns:
        A dict of every option, checked.

    Raises:
        ValueError, TypeError, NotImplementedError: naming the option.
    """
    checked = check_option_values({**defaults, **options})
    backend_check(checked, defaults)
    return checked


def check_option_values(options):
    """`FastGradModel`'s options (a dict with every name), validated:
    the checked values, or the first Keras-style error."""
    micro_batches = check_int(
        "micro_batches",
        options["micro_batches"],
        1,
        " (slices of each batch, run one after the other)",
    )
    multitask = check_multitask(options["multitask"])
    if micro_batches > 1 and multitask is not None and (options["multitask_space"] == "features"):
        raise ValueError(
            '`micro_batches` and `multitask_space="features"` cannot be '
            "combined yet: the features-space merge needs each task's "
            "gradient over the representation of the whole batch. Received: "
            f"micro_batches={micro_batches}, multitask={multitask!r}, "
            "multitask_space='features'. Fix: use `accumulation_steps` with "
            'smaller batches, or `multitask_space="parameters"`.'
        )
    return {
        "accumulation_steps": check_accumulation_steps(options["accumulation_steps"]),
        "clip_norm": check_clip_norm(options["clip_norm"]),
        **check_clip_adaptive(options["clip_adaptive"], options["clip_adaptive_eps"]),
        "multitask": multitask,
        "skip_nonfinite": check_bool("skip_nonfinite", options["skip_nonfinite"]),
        "telemetry": check_bool("telemetry", options["telemetry"]),
        "micro_batches": micro_batches,
        "max_consecutive_nonfinite": check_optional_int(
            "max_consecutive_nonfinite",
            options["max_consecutive_nonfinite"],
            1,
            " (dropped micro-batches in a row before training stops) or None",
        ),
        **check_multitask_space(
            options["multitask_space"], options["multitask_features"], multitask
        ),
        "batchnorm_statistics": check_batchnorm_statistics(options["batchnorm_statistics"]),
    }


def check_batchnorm_statistics(value):
    """Returns `value` if it is one of `keras_fastgrad.step.batchnorm.CHOICES`."""
    return check_choice("batchnorm_statistics", value, BATCHNORM_CHOICES)
