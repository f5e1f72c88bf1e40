"""`SavingHooks`, a base class of `FastGradModel`: its overrides of the Keras
methods that make, save, load, clone and pickle a model by its class
(`__new__`, `__reduce__`, `get_config`, `from_config`,
`compile_from_config`), each calling the work in `models/config.py` or
`models/_keras_hooks.py`.
"""

from keras_fastgrad import _compat as compat
from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration
from keras_fastgrad.models import config as model_config
from keras_fastgrad.step import option_checks


class SavingHooks:
    """The Keras hooks that name `FastGradModel`'s class (as Keras' `Model`
    inherits its `Trainer`): every method calls `super()`'s, so this class
    comes before `keras.Model` among the model's bases."""

    def __new__(cls, *args, **kwargs):
        # Like `keras.Model.__new__`, but the functional form is an instance
        # of a class that also inherits from `Functional`: this class's
        # bases never change.
        functional = integration.is_functional_call(cls, args, kwargs)
        if functional and not issubclass(cls, compat.Functional):
            cls = integration.functional_variant(cls)
        instance = super().__new__(cls, *args, **kwargs)
        if functional:  # read (and removed) by `__init__`
            options = integration.cloned_options(compat.caller_frame(1), _base(cls))
            if options is not None:
                vars(instance)["_fg_cloned_options"] = options
        return instance

    def __reduce__(self):
        # Keras pickles a model as its `.keras` bytes plus the class's
        # `_unpickle_model`, which pickle finds by the class's name; the
        # functional variants and `fastgrad`'s classes share their name with
        # another class. Loading goes by the file's registered names anyway.
        _, args = super().__reduce__()
        return (compat.unpickle_model_function(_base(type(self))), args)

    def compile_from_config(self, config):
        if type(self).compile is not _base(type(self)).compile:  # a subclass's own
            return super().compile_from_config(config)
        integration.compile_from_config(self, config)

    @compat.keras_default  # Keras' automatic config of a subclass's own arguments
    def get_config(self):
        return model_config.with_options(
            super().get_config(), type(self), _base(type(self)), self._fg_options()
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The options are set after Keras has built the model from the rest
        # (a subclass's `__init__`, a `Sequential`'s layers, ...).
        base = _base(cls)
        names = model_config.option_names(base)
        config, options = model_config.pop_options(config, cls, base, names)
        model = super().from_config(config, custom_objects=custom_objects)
        if options and isinstance(model, base):
            options = {**model._fg_options(), **options}
            defaults = model_config.default_options(base)
            checked = option_checks.checked_options(options, defaults, _backend.check_options)
            model._fg_set_options(checked)
        return model

    def _fg_options(self):
        """The constructor's options, serializable (`get_config`, clones)."""
        names = model_config.option_names(_base(type(self)))
        return model_config.serializable_options(self, names)


def _base(cls):
    """The class among `cls`'s bases that has these hooks as its own base
    (`FastGradModel`): its constructor's keyword-only arguments are the
    options."""
    return next(k for k in cls.__mro__ if SavingHooks in k.__bases__)
