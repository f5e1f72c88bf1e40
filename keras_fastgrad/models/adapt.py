"""`fastgrad(model)`: `FastGradModel`'s train step for a model you have.

A model built elsewhere (`keras.applications`, a KerasHub task, a plain
functional `keras.Model`, `keras.Sequential`, your own `keras.Model`
subclass) gets the step in place: its class becomes a subclass of both
`FastGradModel` and its own class, so its methods keep working and its
weights stay where they are.

- a plain functional model becomes a functional `FastGradModel`, a
  `keras.Sequential` a `FastGradSequential`;
- any other class `C` gets a subclass `(FastGradModel, C)` named like `C`,
  saved as a wrapper (`FastGradAdapter`) around `C`'s own config, so a
  `.keras` file loads back into a `C` with the step and its options.

The callbacks of `keras_fastgrad.callbacks` use `attach` / `detach` to give
the `fit` of a plain model the measuring step for that `fit` only; the model
is a `FastGradModel` only while that step and the callbacks' hooks run
(`stepping`), so a `fit` that raises leaves it as it was.
"""

import contextlib
import difflib
import inspect

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad import aggregators
from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration
from keras_fastgrad.models._keras_hooks import functional_variant
from keras_fastgrad.models.model import (
    OPTION_NAMES,
    FastGradModel,
    _checked_options,
)
from keras_fastgrad.models.options import check_compiled
from keras_fastgrad.models.sequential import FastGradSequential

_ADAPTER_NAME = "keras_fastgrad>FastGradAdapter"
_shell = _backend.shell()


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
    _check_model(model)
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
    detach(model)  # what a `fit` with our callbacks that raised left
    _give_step(model, checked)
    if model.compiled:
        model._fg_after_compile()
    return model


def attach(model):
    """Gives a plain model the step for one `fit` (the callbacks' case):
    default options that train exactly like `keras.Model` (nothing
    skipped, never stopped). Returns whether the model is attached for
    this `fit` (also when another callback of the same `fit` attached it
    first; not for a model that has the step of its own); `detach` undoes
    it, from whichever of those callbacks ends first.

    The model stays an instance of its own class: it becomes a
    `FastGradModel` only while keras_fastgrad's code runs (its train
    function, built by the `make_train_function` that `attach` puts on
    the instance, and the hooks of the callbacks; see `stepping`). So an
    exception anywhere else in `fit` (a callback, an interrupt between
    batches) leaves a plain model: its type, `save`, `save_weights` and
    `get_config` are a plain model's. What `fit` cannot undo when it raises
    (the instance's `make_train_function` and train function) undoes itself
    at the next training call that no callback of ours prepared
    (`_Attachment.train_function`)."""
    attachment = _attachment(model)
    if attachment is not None:
        if not attachment.used:  # another callback of this `fit` attached
            return True
        detach(model)  # left by a `fit` that raised: start afresh
    if isinstance(model, FastGradModel):
        return False
    _check_model(model)
    _Attachment(model)
    return True


def detach(model):
    """Undoes `attach`: the model's own class and train function again."""
    attachment = _attachment(model)
    if attachment is not None:
        attachment.detach()


def stepping(model):
    """A context in which `model` is the `FastGradModel` that `attach`
    made of it (its class and the step's state and options); outside,
    the plain model it is. Does nothing for a model that is not attached.
    Re-entrant."""
    attachment = _attachment(model)
    return contextlib.nullcontext() if attachment is None else attachment


def prepare_call(model):
    """Marks the next call of an attached model's train function as one
    of a `fit` whose callbacks asked for the step (the callbacks'
    `on_train_batch_begin`)."""
    attachment = _attachment(model)
    if attachment is not None:
        attachment.prepared = True


def _attachment(model):
    return vars(model).get("_fg_attachment") if model is not None else None


class _Attachment:
    """What `attach` gives a plain model, kept off the model between calls.

    The class of the step and the instance attributes it needs (the
    step's state and options: `FastGradModel._fg_setup`) are put on the
    model on `__enter__` and taken off on `__exit__` (a class assignment
    and a dozen dict entries: microseconds per call). Between calls the
    model holds only the `make_train_function` of `attach`, its train
    function and this object, none of which Keras saves.
    """

    def __init__(self, model):
        self.model = model
        self.original = type(model)
        self.step_class = _step_class(self.original)
        self.depth = 0
        self.used = False  # a train function was made: the `fit` started
        self.prepared = False
        self.detached = False
        self.state_from_step = False  # JAX: the last state came from the step
        before = set(vars(model))
        model.__class__ = self.step_class
        try:
            model._fg_setup(_checked_options(skip_nonfinite=False, max_consecutive_nonfinite=None))
        finally:
            model.__class__ = self.original
        self.stash = {k: vars(model).pop(k) for k in set(vars(model)) - before}
        # `object.__setattr__`: not tracked by Keras (nor saved).
        object.__setattr__(model, "_fg_attachment", self)
        object.__setattr__(model, "make_train_function", self.make_train_function)
        for name in _shell.STATE_METHODS:  # (JAX's; none on TensorFlow)
            object.__setattr__(model, name, self._state_method(name))
        model.train_function = None  # traced again, with the step

    def __enter__(self):
        if self.depth == 0 and not self.detached:
            vars(self.model).update(self.stash)
            self.model.__class__ = self.step_class
        self.depth += 1
        return self.model

    def __exit__(self, *exc_info):
        self.depth -= 1
        if self.depth == 0:
            model = self.model
            model.__class__ = self.original
            attributes = vars(model)
            for name in self.stash:
                if name in attributes:
                    self.stash[name] = attributes.pop(name)
        return False

    def make_train_function(self, force=False):
        """The model's `make_train_function` while attached: the step's
        train function, called through `train_function`. On TensorFlow, a
        model that still needs building (unbuilt: Keras builds it only in
        the first trace, after the callbacks attached; or variables only
        a training call creates) gets the step's train function at its
        first call, built first from that call's data
        (`_keras_hooks.build_from_the_first_call`): the step's state and
        the optimizer are built for the model's variables, as
        `FastGradModel`'s `_maybe_symbolic_build` builds them."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        traced = []  # the step's train function, once made
        if _shell.BUILDS_BEFORE_FIT or not _needs_build(model):
            traced.append(self._step_train_function())
        self.used = True

        def train_function(*args):  # TF: `(iterator)`; JAX: `(state, iterator)`
            return self.train_function(traced, *args)

        model.train_function = train_function
        return train_function

    def _step_train_function(self, data_iterator=None):
        """The step's train function (the model built first from
        `data_iterator`'s batches, when given)."""
        model = self.model
        with self:  # (Keras' version sets `train_function`, returns nothing)
            if data_iterator is not None:
                integration.build_from_the_first_call(model, data_iterator)
            self.step_class.make_train_function(model, force=True)
        return model.train_function

    def train_function(self, traced, *args):
        if not self.prepared:
            # No callback of ours announced this call: the `fit` that
            # attached the step raised, and this is a later training call
            # (a `fit` without our callbacks, `train_on_batch`).
            self.detach()
            self.model.make_train_function()
            return self.model.train_function(*args)
        if not traced:  # TensorFlow, a model to build: from this call's data
            own = self.model.train_function
            traced.append(self._step_train_function(args[-1]))
            self.model.train_function = own
        self.prepared = False
        self.state_from_step = True
        with self:  # tracing (first call, new shapes) needs the class
            return traced[0](*args)

    def _state_method(self, name):
        """Keras' trainer method `name` (the shell's `STATE_METHODS`),
        run on the step's variable lists (the step's own variables ride
        at the end of `non_trainable_variables`) when the state it reads
        or writes is the step's: the state a prepared call will take, or
        the one the step returned last."""
        original = getattr(self.original, name)

        def method(*args, **kwargs):
            from_step = self.prepared if name == "_get_jax_state" else self.state_from_step
            if not from_step or self.detached:
                return original(self.model, *args, **kwargs)
            with self:
                return original(self.model, *args, **kwargs)

        return method

    def detach(self):
        model = self.model
        self.detached = True
        for name in ("_fg_attachment", "make_train_function", *_shell.STATE_METHODS):
            if name in vars(model):
                object.__delattr__(model, name)
        if self.depth == 0:
            model.__class__ = self.original
        else:  # inside `stepping`: `__exit__` restores the class
            for name in self.stash:
                vars(model).pop(name, None)
            self.stash = {}
        model.train_function = None


def _needs_build(model):
    """Whether `model` must be built before the step's state is: unbuilt,
    or never trained with layers still unbuilt (`builds_itself` without
    the strategy's case: under one Keras' `fit` has built it)."""
    return not model.built or integration._first_training(model)


def _give_step(model, options):
    model.__class__ = _step_class(type(model))
    model._fg_setup(options)
    model.train_function = None  # traced again, with the step


def _check_model(model):
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


def _step_class(cls):
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
