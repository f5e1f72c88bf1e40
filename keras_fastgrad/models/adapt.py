"""`fastgrad(model)`: `FastGradModel`'s train step for a model you have.

A model built elsewhere (`keras.applications`, a KerasHub task, a plain
functional `keras.Model`, `keras.Sequential`, your own `keras.Model`
subclass) gets the step in place: its class becomes a subclass of both
`FastGradModel` and its own class, so its methods keep working and its
weights stay where they are:

- a plain functional model becomes a functional `FastGradModel`, a
  `keras.Sequential` a `FastGradSequential`;
- any other class `C` gets a subclass `(FastGradModel, C)` named like `C`,
  saved as a wrapper (`FastGradAdapter`) around `C`'s own config, so a
  `.keras` file loads back into a `C` with the step and its options.

The callbacks give a plain model the step for one `fit` only
(`models/attachment.py`, with `check_model` and `step_class` from here).
"""

import difflib
import inspect

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad import aggregators
from keras_fastgrad.models._keras_hooks import functional_variant
from keras_fastgrad.models.model import (
    OPTION_NAMES,
    FastGradModel,
    _checked_options,
)
from keras_fastgrad.models.sequential import FastGradSequential
from keras_fastgrad.step.compile_checks import check_compiled


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
    check_model(model)
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
    # What a `fit` with our callbacks that raised left (`attachment.attach`).
    left = vars(model).get("_fg_attachment")
    if left is not None:
        left.detach()
    _give_step(model, checked)
    if model.compiled:
        model._fg_after_compile()
    return model


def _give_step(model, options):
    model.__class__ = step_class(type(model))
    model._fg_setup(options)
    model.train_function = None  # traced again, with the step


_ADAPTER_NAME = "keras_fastgrad>FastGradAdapter"


def check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model` (functional, `Sequential` or a "
            f"subclass). Received: model of type {type(model).__name__}"
        )
    cls = type(model)
    if "train_step" in vars(model):
        raise ValueError(
            "`model.train_step` is replaced on the instance (by "
            f"`{getattr(vars(model)['train_step'], '__qualname__', 'a callable')}`): "
            "giving it `FastGradModel`'s step would silently keep running "
            "that step, which measures nothing. Received: a "
            f"`{cls.__name__}` with its own `train_step` attribute. Fix: "
            "`del model.train_step` to train with Keras' step (then "
            "`FastGradModel`'s), or keep the model's own step and leave "
            "keras_fastgrad out of this `fit`."
        )
    if not isinstance(model, FastGradModel) and cls.train_step is not keras.Model.train_step:
        owner = next(k for k in cls.__mro__ if "train_step" in vars(k))
        raise ValueError(
            f"`{cls.__name__}` overrides `train_step` (in "
            f"`{owner.__module__}.{owner.__qualname__}`): giving it "
            "`FastGradModel`'s step would silently replace that step. Fix: "
            "keep the model's own step, or move what it adds to `call` / "
            "`compute_loss` (which `FastGradModel`'s step calls)."
        )


def step_class(cls):
    """The class with the step for a model of class `cls`."""
    if cls is compat.Functional:
        return functional_variant(FastGradModel)
    if cls is keras.Sequential:
        return FastGradSequential
    adapted = _ADAPTED.get(cls)
    if adapted is None:
        adapted = _ADAPTED[cls] = _adapted_class(cls)
    return adapted


_ADAPTED = {}


def _adapted_class(cls):
    """`(FastGradModel, cls)`, named like `cls` and built like `cls`."""
    own_init = cls.__init__

    def __init__(self, *args, **kwargs):
        # Reached by Keras (a clone); `fastgrad` converts instances instead.
        options = (
            kwargs.pop("fastgrad_options", None) or vars(self).pop("_fg_cloned_options", None) or {}
        )
        own_init(self, *args, **kwargs)
        self._fg_setup(_checked_options(**options))

    __init__.__signature__ = inspect.signature(own_init)

    def get_config(self):
        config = cls.get_config(self)
        return {
            "model": {
                "module": cls.__module__,
                "class_name": cls.__name__,
                "registered_name": keras.saving.get_registered_name(cls),
                "config": config,
            },
            "fastgrad_options": self._fg_options(),
        }

    # Keras' automatic config (of `cls`'s constructor arguments) applies
    # exactly when it applies to `cls`.
    get_config = compat.with_default_mark(get_config, compat.is_keras_default(cls.get_config))
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__init__": __init__,
        "get_config": get_config,
        "from_config": classmethod(_adapter_from_config),
        "_fg_adapted_from": cls,
    }
    adapted = type(cls.__name__, (FastGradModel, cls), namespace)
    compat.serialize_as(adapted, _ADAPTER_NAME)
    return adapted


def _adapter_from_config(cls, config, custom_objects=None):
    original = vars(cls).get("_fg_adapted_from")
    if "model" not in config:
        # Keras resolved the name of the model's own class to the adapted
        # class (`clone_model` does): the inner config, built plain.
        return original.from_config(config)
    inner = config["model"]
    if original is not None:  # the adapted class itself, in-process
        model = original.from_config(inner["config"])
    else:  # loading a file: the model's own class, by its registered name
        model = keras.saving.deserialize_keras_object(inner, custom_objects=custom_objects)
    return fastgrad(model, **config.get("fastgrad_options", {}))


@keras.saving.register_keras_serializable(package="keras_fastgrad")
class FastGradAdapter:
    """What a `.keras` file names for a model given the step by `fastgrad`
    (of a class other than functional / `Sequential`): loads the model's
    own config, then gives it the step with the saved options."""

    from_config = classmethod(_adapter_from_config)

    def get_config(self):  # (never instantiated; Keras' registry wants it)
        return {}
