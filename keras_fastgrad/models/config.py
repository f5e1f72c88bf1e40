"""`FastGradModel`'s options in its Keras config, and its keywords.

`get_config` writes the options beside Keras' own keys; a subclass with an
`__init__` of its own (which may not take them as keywords) gets them under
`fastgrad_options` instead. `from_config` sets them after Keras has built
the model from the rest (a subclass's `__init__`, a `Sequential`'s layers,
...). The keyword lists tell the options apart from `keras.Model`'s own
keywords, for the constructor's refusal of unknown names
(`keras_fastgrad.step.option_checks.check_keyword_names`).
"""

import functools
import inspect

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad import aggregators

# The keywords `keras.Model` accepts besides ours: the functional form's
# (`Functional.__init__`: `inputs`, `outputs`, `name`, `trainable`) and the
# subclassed form's (`keras.layers.Layer.__init__`'s, with the `input_dim` /
# `input_shape` it reads from its `**kwargs`).
KERAS_KEYWORDS = tuple(
    sorted(
        {"inputs", "outputs", "input_dim", "input_shape"}
        | {
            name
            for function in (keras.layers.Layer.__init__, compat.Functional.__init__)
            for name, p in inspect.signature(function).parameters.items()
            if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
        }
    )
)


@functools.lru_cache(maxsize=None)
def option_names(base):
    """The names of `base.__init__`'s keyword-only arguments (the options)."""
    return tuple(default_options(base))


def default_options(base):
    """`{name: default}` of `base.__init__`'s keyword-only arguments (the
    options, read off the constructor's signature)."""
    return {
        name: p.default
        for name, p in inspect.signature(base.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


@functools.lru_cache(maxsize=None)
def keras_keywords(cls, base):
    """`KERAS_KEYWORDS` and those of the `__init__`s that `base`'s
    `super().__init__` reaches in `cls` (`keras.Sequential`'s `layers`)."""
    mro = cls.__mro__
    names = set(KERAS_KEYWORDS)
    for klass in mro[mro.index(base) + 1 :]:
        if "__init__" in vars(klass) and klass is not object:
            names.update(
                name
                for name, p in inspect.signature(vars(klass)["__init__"]).parameters.items()
                if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            )
    return tuple(sorted(names))


def serializable_options(model, option_names):
    """The model's options (`option_names`), serializable: the `multitask`
    aggregator as its config (`get_config`, clones)."""
    options = {name: getattr(model, name) for name in option_names}
    if options.get("multitask") is not None:
        options["multitask"] = aggregators.serialize(options["multitask"])
    return options


def takes_options(cls, base):
    """Whether `cls(**config)` reaches `base.__init__` with the options as
    keywords (no `__init__` of the subclass's own)."""
    return all("__init__" not in vars(klass) for klass in cls.__mro__[: cls.__mro__.index(base)])


def with_options(config, cls, base, options):
    """`config` (Keras' own) with `options` added where `from_config` will
    find them (see the module docstring)."""
    if takes_options(cls, base):
        config.update(options)
    else:  # a subclass with its own `__init__`: applied by `from_config`
        config["fastgrad_options"] = options
    return config


def pop_options(config, cls, base, option_names):
    """`(config, options)`: Keras' own config and the options saved by
    `with_options`, taken out of it."""
    config = dict(config)
    options = config.pop("fastgrad_options", None) or {}
    if takes_options(cls, base):
        options.update({k: config.pop(k) for k in option_names if k in config})
    return config, options
