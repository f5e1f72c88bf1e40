"""A plain model given the step for one `fit` (the callbacks' case).

The callbacks of `keras_fastgrad.callbacks` use `attach` / `detach` to give
the `fit` of a plain model the measuring step for that `fit` only; the model
is a `FastGradModel` only while that step and the callbacks' hooks run
(`stepping`), so a `fit` that raises leaves it as it was.
"""

import contextlib

from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration
from keras_fastgrad.models.adapt import check_model, step_class
from keras_fastgrad.models.model import FastGradModel, _checked_options

_shell = _backend.shell()


def attach(model):
    """Gives a plain model the step for one `fit` (the callbacks' case), with
    default options that train exactly like `keras.Model` (nothing skipped,
    never stopped). The model is a `FastGradModel` only inside `stepping`;
    everywhere else (`save`, `get_config`, a `fit` that raised) it is the
    plain model. A train function left by a `fit` that raised detaches
    itself at the next training call no callback prepared.

    Returns:
        Whether the model is attached for this `fit` (also when another
        callback of the same `fit` attached it first); `False` for a model
        that has the step of its own. `detach` undoes it.

    Raises:
        TypeError, ValueError: as `fastgrad` refuses the model."""
    attachment = _attachment(model)
    if attachment is not None:
        if not attachment.used:  # another callback of this `fit` attached
            return True
        detach(model)  # left by a `fit` that raised: start afresh
    if isinstance(model, FastGradModel):
        return False
    check_model(model)
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
    model on `__enter__` and taken off on `__exit__`. Between calls the
    model holds only the `make_train_function` of `attach`, its train
    function and this object, none of which Keras saves.
    """

    def __init__(self, model):
        self.model = model
        self.original = type(model)
        self.step_class = step_class(self.original)
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
        train function, called through `train_function`. A model that
        still needs building (`_needs_build`, on a shell that does not build
        it before `fit`) gets it at its first call, built first from that
        call's data (`_keras_hooks.build_from_the_first_call`)."""
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
