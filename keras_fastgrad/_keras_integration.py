"""Where `FastGradModel` meets Keras' own machinery.

Keras hooks overridden here, each for one reason:
- `__new__`: the functional form gets its own class (see
  `_functional_variant`) instead of Keras rewriting the class's bases; a
  clone made by `keras.models.clone_model` gets the original's options (see
  `_model_being_cloned`).
- `__reduce__`: pickling (Keras pickles the class by name, and a
  functional variant shares its name with the class it extends).
- `compile_from_config`: Keras skips recompiling a loaded model whose
  `compile` is overridden; ours keeps Keras' signature.
- `_maybe_symbolic_build`: the step's state needs the variables (also
  those only `training=True` creates) before the first trace; and under
  MultiWorkerMirroredStrategy Keras' own version fails.
- `fit` / `_get_metrics_result_or_logs`: the place, right after an epoch's
  last batch and before validation, to apply a partial accumulation window
  (not when `evaluate`, which ends the same way, runs inside `fit`).
"""

import sys

import keras
import tensorflow as tf
from keras import tree

from keras_fastgrad import _keras_compat as compat


class KerasIntegrationMixin:
    """Overrides of Keras internals that `FastGradModel` relies on."""

    def __new__(cls, *args, **kwargs):
        # Like `keras.Model.__new__`: the functional form is an instance of
        # a class that also inherits from `Functional` (see
        # `_functional_variant`), so this class's bases never change.
        functional = compat.functional_init_arguments(args, kwargs) and not (
            issubclass(cls, keras.Sequential)
        )
        if functional and not issubclass(cls, compat.Functional):
            cls = _functional_variant(cls)
        instance = super().__new__(cls, *args, **kwargs)
        if functional:
            source = _model_being_cloned(sys._getframe(1))
            if source is not None:  # read (and removed) by `__init__`
                vars(instance)["_fg_cloned_options"] = source._fg_options()
        return instance

    def __reduce__(self):
        # Keras pickles a model as its `.keras` bytes plus the class's
        # `_unpickle_model`, which pickle finds by the class's name; the
        # functional variants and `fastgrad`'s classes share their name with
        # another class. Loading goes by the file's registered names anyway.
        _, args = super().__reduce__()
        return (self._fg_compile_owner()._unpickle_model, args)

    def _fg_compile_owner(self):
        """The class whose `compile` keeps Keras' signature."""
        from keras_fastgrad.model import FastGradModel

        return FastGradModel

    def compile_from_config(self, config):
        # Keras skips recompiling on load when `compile` is overridden; ours
        # keeps the signature, so recompile (unless a subclass overrides it).
        if type(self).compile is not self._fg_compile_owner().compile:
            return super().compile_from_config(config)
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # The step's state (accumulators) and the optimizer are built before
        # the train function is traced, for the variables of the model as it
        # trains: so the first training call also creates those that only
        # `call(..., training=True)` would create (an auxiliary head), which
        # Keras leaves to the first trace (it builds its optimizer on the
        # first update). Symbolically: no weight, moving statistic or seed
        # moves. Keras builds an unbuilt model symbolically only under a
        # strategy; we build it without one too, except when `run_eagerly`:
        # `call` may then hold eager-only Python (see `_fg_build_eagerly`).
        strategy = compat.own_distribute_strategy(self)
        optimizer = getattr(self, "optimizer", None)
        # Once every layer is built (a functional model, say), there is no
        # variable left for a training call to create.
        first_training = (
            optimizer is not None
            and not optimizer.built
            and not all(layer.built for layer in compat.flatten_layers(self))
        )
        if strategy is None and self.built and not first_training:
            return super()._maybe_symbolic_build(iterator, data_batch)
        strategy = self.distribute_strategy
        if iterator is not None:
            # Under a strategy, Keras averages one distributed batch with
            # `strategy.reduce`, which `MultiWorkerMirroredStrategy` cannot
            # do eagerly (plain `keras.Model.fit` fails there); the build
            # only needs the batch's structure, shapes and dtypes: replica
            # 0's part has them.
            data_batch = tree.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v,
                compat.first_batch(iterator),
            )
        eager = compat.own_distribute_strategy(self) is None and self.run_eagerly
        with strategy.scope():
            training_built = first_training and self._fg_build_training_variables(
                data_batch, quiet=eager
            )
            if eager and not training_built:
                self._fg_build_eagerly(data_batch)
            elif not eager:
                compat.symbolic_build(self, data_batch)

    def _fg_build_training_variables(self, data_batch, quiet):
        """Creates the variables of `call(x, training=True)` with a symbolic
        forward pass. Returns whether it ran; when it fails and `quiet`
        (an eager-only `call`), returns `False` instead of raising."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
        x = tree.map_structure(
            lambda v: None if v is None
            else keras.KerasTensor(v.shape, keras.backend.standardize_dtype(v.dtype)),
            x,
        )
        kwargs = {"training": True} if compat.call_has_training_arg(self) else {}
        try:
            compat.compute_output_spec(self, x, **kwargs)
        except Exception as e:
            if quiet:
                return False
            if isinstance(e, ValueError):  # invalid inputs: as Keras raises
                raise
            raise RuntimeError(
                "Unable to build the model's training variables (a symbolic "
                "call with `training=True`) before the first train step. "
                "Build the model yourself, or compile it with "
                "`run_eagerly=True` if its `call` runs only eagerly.\n"
                f"Exception encountered:\n'{e}'"
            ) from e
        return True

    def _fg_build_eagerly(self, data_batch):
        """Builds an unbuilt `run_eagerly` model by calling it on the batch,
        with `training=False` (no moving statistic or seed moves), as
        Keras' symbolic build does but eagerly: its `call` may hold
        eager-only Python (`float(tensor)`, `.numpy()`). Variables that only
        `training=True` creates are then not built before the first step."""
        if all(layer.built for layer in compat.flatten_layers(self)):
            return  # (`model.build(shape)` may have left layers unbuilt)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
        kwargs = {"training": False} if compat.call_has_training_arg(self) else {}
        self(x, **kwargs)

    def fit(self, *args, **kwargs):
        if self.max_consecutive_nonfinite is not None:
            if len(args) > 5:  # `callbacks` given by position
                args = args[:5] + (_with_divergence_stop(self, args[5]),) + args[6:]
            else:
                kwargs["callbacks"] = _with_divergence_stop(self, kwargs.get("callbacks"))
        self._fg_in_fit = True
        try:
            return super().fit(*args, **kwargs)
        finally:
            self._fg_in_fit = False

    def evaluate(self, *args, **kwargs):
        # `evaluate` ends with `_get_metrics_result_or_logs` too; called by
        # a callback inside `fit`, it must not apply the pending window.
        self._fg_evaluating += 1
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._fg_evaluating -= 1

    def _get_metrics_result_or_logs(self, logs):
        # Keras calls this right after an epoch's last batch, before
        # validation and `on_epoch_end`: the place to apply a partial window.
        if self._fg_in_fit and not self._fg_evaluating:
            flushed = self.apply_partial_window()
            if flushed is not None and isinstance(logs, dict):
                logs = {**logs, **{k: flushed[k] for k in logs if k in flushed}}
        return super()._get_metrics_result_or_logs(logs)


def _with_divergence_stop(model, callbacks):
    """The user's callbacks plus a `DivergenceStop` reading the model's
    streak (created with the step's state, on first use)."""
    from keras_fastgrad.divergence import DivergenceStop

    if callbacks is None:
        callbacks = []
    elif isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = list(callbacks.callbacks)
    else:
        callbacks = list(callbacks)
    return callbacks + [DivergenceStop(lambda: model._fg_divergence)]


def _model_being_cloned(frame):
    """The model that `keras.models.clone_model` is cloning, if the model
    under construction is that clone, else `None`.

    Args:
        frame: The frame that called the class (`__new__`'s caller).
    """
    # A subclass that overrides `__new__` sits between the caller and here.
    while frame is not None and frame.f_code.co_name == "__new__":
        frame = frame.f_back
    # `keras.models.clone_model` builds a functional clone as
    # `model.__class__(inputs, outputs, name=model.name)`: no options, and
    # no hook that would let the class pass them on.
    model = compat.model_cloned_in(frame)
    return model if isinstance(model, KerasIntegrationMixin) else None


_FUNCTIONAL_VARIANTS = {}


def _functional_variant(cls):
    """`cls` + `Functional`, for `cls(inputs, outputs, ...)`.

    Keras makes a `Model` subclass functional by rewriting the class's bases
    (`inject_functional_model_class`), which breaks every later subclassed
    use of that class, and of `FastGradModel`. A dedicated subclass per
    class leaves the user's classes alone. It keeps the class's name and
    serializes under the class's registered name, so a `.keras` file names
    the user's class and loading it comes back here.
    """
    variant = _FUNCTIONAL_VARIANTS.get(cls)
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, compat.Functional),
            {"__module__": cls.__module__, "__doc__": cls.__doc__, "__qualname__": cls.__qualname__},
        )
        compat.register_serialized_name(variant, cls)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return variant
