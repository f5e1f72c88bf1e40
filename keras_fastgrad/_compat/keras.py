"""Keras' private API, behind small named functions: the model's and
trainer's private members, `CompileLoss`, saving, cloning, callbacks, the
functional graph, and the Keras version branches (supported: Keras >= 3.8).

Imports neither TensorFlow nor JAX; the rest of the package reaches these
names through `keras_fastgrad._compat` (the package re-exports them).
"""

import contextlib
import inspect
import sys

import keras

# Re-exported as they are (the rest of the package imports them from here).
from keras.src.backend import compute_output_spec  # noqa: F401
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask  # noqa: F401
from keras.src.backend.common.symbolic_scope import in_symbolic_scope  # noqa: F401
from keras.src.losses.loss import (  # noqa: F401
    apply_mask,
    reduce_weighted_values,
    unscale_loss_for_distribution,
)
from keras.src.models import cloning as _cloning
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments  # noqa: F401
from keras.src.saving import object_registration as _object_registration
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.trainers.trainer import Trainer
from keras.src.utils import python_utils as _python_utils

KERAS_VERSION = tuple(int(p) for p in keras.__version__.split(".")[:2])
MIN_KERAS_VERSION = (3, 8)
# Keras creates metric variables sync-on-read (per replica, summed when
# read) from 3.10 on. Before, they are mirrored on write and every metric
# update is a `merge_call`, which the step cannot run inside its `cond`s in
# replica context: several replicas need Keras >= 3.10.
MULTI_REPLICA_SUPPORTED = KERAS_VERSION >= (3, 10)

# Imported above and used as they are elsewhere in the package:
# `Functional`, `KerasSaveable`, `Trainer`, `apply_mask`,
# `compute_output_spec`, `functional_init_arguments`, `get_keras_mask`,
# `set_keras_mask`, `reduce_weighted_values`, `unscale_loss_for_distribution`.

# ------------------------------------------------------------------ model
# Private `keras.Model` (Trainer / Layer) members read or called.


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras' own `train_step` computes it (the
    wrapper around `compute_loss` that passes `training=True` only to an
    override that accepts it)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


def compute_loss_function(model):
    """`model._compute_loss` (or the public `compute_loss` where absent):
    a callable of `(x, y, y_pred, sample_weight, training)`."""
    return getattr(model, "_compute_loss", model.compute_loss)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` log (set by `compile`)."""
    return model._loss_tracker


def update_compiled_metrics(model, y, y_pred, sample_weight):
    """The compiled metrics' update, as `keras.Model.compute_metrics` does
    it, without reading the results."""
    if model._compile_metrics is not None:
        model._compile_metrics.update_state(y, y_pred, sample_weight)


def set_loss_tracker(model, tracker):
    """Replaces the `loss` tracker, as `compile` sets it: not tracked as a
    user metric (`object.__setattr__` bypasses Keras' attribute tracking)."""
    object.__setattr__(model, "_loss_tracker", tracker)


def additional_loss(model, loss):
    """One entry of `model.losses` cast and scaled for distribution, as
    `keras.Model.compute_loss` adds it."""
    return model._aggregate_additional_loss(loss)


def symbolic_build(model, data_batch):
    """Builds the model, compiled loss and metrics, and optimizer with a
    symbolic pass on `data_batch` (what `fit` does before the first step)."""
    model._symbolic_build(data_batch=data_batch)


def own_distribute_strategy(model):
    """The strategy the model was created under, or `None` (the public
    `distribute_strategy` falls back to the default strategy)."""
    return model._distribute_strategy


def flatten_layers(model, include_self=True):
    """Every layer of the model, itself included unless `include_self` is
    `False`, recursively."""
    return model._flatten_layers(include_self=include_self)


def own_losses(layer):
    """The losses `layer` itself added (`add_loss`, its activity
    regulariser), without its sublayers' or any weight regulariser's."""
    return layer._get_own_losses()


def has_own_losses(layer):
    """Whether `layer` itself added losses (`add_loss`, its activity
    regulariser) in its last call. After a stateless call (Keras' JAX
    trainer) the losses went with the call's `StatelessScope`; Keras keeps
    their ids (`_loss_ids`) until the layer's next call."""
    return bool(layer._get_own_losses()) or bool(getattr(layer, "_loss_ids", None))


def losses_overridden(model):
    """Whether `model.losses` was replaced (Keras' `_losses_override`)."""
    return bool(getattr(model, "_losses_override", None))


@contextlib.contextmanager
def forward_losses(model, losses):
    """Within the block, `model.losses` is `losses`: a stateless forward's
    (`stateless_call(..., return_losses=True)`), as Keras' JAX trainer
    hands them to `compute_loss`. No-op for no losses."""
    if not losses:
        yield
        return
    before = model._losses_override
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._losses_override = before


def first_batch(iterator):
    """The next batch of the `EpochIterator` that `fit` passes to
    `_maybe_symbolic_build`. Its entries are `(step, data_iterator)` before
    Keras 3.11, `(begin_step, end_step, data_iterator)` from 3.11 on."""
    for entry in iterator:
        return next(entry[-1])
    return None


# Before Keras 3.11, `fit` passes the FIRST batch of a train function call
# (`steps_per_execution` batches) to `on_train_batch_end`; from 3.11 on, the
# last (`end_step`, not capped at the epoch's end).
_BATCH_END_REPORTS_LAST = KERAS_VERSION >= (3, 11)


def last_batch(model, batch):
    """The 0-based index of the last batch of the train function call that
    `on_train_batch_end(batch, ...)` reports, as Keras >= 3.11 passes it."""
    if _BATCH_END_REPORTS_LAST:
        return batch
    return batch + (getattr(model, "steps_per_execution", None) or 1) - 1


def init_functional(model, args, kwargs):
    """What `keras.Model.__init__` does for the functional form
    (`Model(inputs, outputs)`), without injecting `Functional` into the
    class's bases."""
    Trainer.__init__(model)
    Functional.__init__(model, *args, **kwargs)


# Private methods of Keras classes that the package overrides in a class
# body (kept there: moving them would split the class). The canary checks
# that Keras still has, and calls, each of them.
OVERRIDDEN_PRIVATE_METHODS = (
    (keras.Model, "_maybe_symbolic_build", ("iterator", "data_batch")),
    (keras.Model, "_get_metrics_result_or_logs", ("logs",)),
    (KerasSaveable, "_obj_type", ()),
)

# What `StepState._obj_type` returns: Keras' saving walks only a few
# known kinds of objects; "Loss" is one whose own attributes it does not
# walk (the entry has none to save besides its own variables).
SAVEABLE_OBJ_TYPE = "Loss"

# --------------------------------------------------------------- compile loss
# `CompileLoss` calls one loss object per output, from `_flat_losses`
# entries `(path, loss, loss_weights, name)`; the step wraps them.


def compile_loss(model):
    """The model's `CompileLoss` (`None` before `compile` or without a
    compiled loss)."""
    return getattr(model, "_compile_loss", None)


def output_losses(compile_loss):
    """The list of `CompileLoss`'s per-output entries (named tuples with
    `path`, `loss`, `loss_weights`, `name`); `None` before it is built."""
    return compile_loss._flat_losses


def output_loss_metrics(compile_loss):
    """`CompileLoss`'s per-output loss metrics (`<output>_loss`, one `Mean`
    per output of a model with several; none for one output, or on a
    Keras without them)."""
    return list(getattr(compile_loss, "metrics", None) or [])


def set_output_losses(compile_loss, entries):
    """Replaces `CompileLoss`'s per-output entries."""
    compile_loss._flat_losses = list(entries)


def user_loss(compile_loss):
    """The `loss` argument that `compile` received."""
    return compile_loss._user_loss


@contextlib.contextmanager
def once_built(compile_loss, install):
    """Runs `install()` now if `compile_loss` is built, else right after
    Keras builds it (on its first call, which calls `build(y_true,
    y_pred)`) within the block; the hook is removed on exit."""
    patched_build = "build" in vars(compile_loss)
    previous_build = compile_loss.build
    if compile_loss.built:
        install()
    else:

        def build_then_install(y_true, y_pred):
            previous_build(y_true, y_pred)
            install()

        compile_loss.build = build_then_install
    try:
        yield
    finally:
        if patched_build:
            compile_loss.build = previous_build
        else:
            vars(compile_loss).pop("build", None)


# ------------------------------------------------------------ BatchNorm
# `BatchNormalization.call(training=True)` takes the batch's moments with
# `self._moments(inputs, mask)`: the recorder of
# `keras_fastgrad.step.batchnorm_recording` wraps it on the instance.


def batchnorm_moments(layer):
    """The layer's `_moments(inputs, mask) -> (mean, variance)`."""
    return layer._moments


def set_batchnorm_moments(layer, function):
    """Replaces the layer's `_moments` on the instance (`None`: Keras' own
    method again)."""
    if function is None:
        vars(layer).pop("_moments", None)
    else:
        vars(layer)["_moments"] = function


# ------------------------------------------------------------------ saving


def serialize_as(cls, name):
    """Serializes `cls` under the registered name `name` (a string)."""
    _object_registration.GLOBAL_CUSTOM_NAMES[cls] = name


def keras_default(method):
    """Marks `get_config` as Keras' default one: Keras' automatic config
    of the constructor's arguments then applies to subclasses that do not
    define their own (Keras checks the mark on `self.get_config`)."""
    return _python_utils.default(method)


def is_keras_default(method):
    """Whether `method` carries Keras' default-method mark."""
    return _python_utils.is_default(method)


def with_default_mark(function, default):
    """`function`, marked as Keras' default method iff `default`."""
    if default:
        return _python_utils.default(function)
    return function


# ------------------------------------------------------------------ cloning
# `keras.models.clone_model` builds a functional clone in this function as
# `model.__class__(inputs, outputs, name=model.name)`, with the original in
# its local variable `model`.
_CLONE_FUNCTIONAL_CODE = getattr(
    getattr(_cloning, "_clone_functional_model", None), "__code__", None
)


def model_cloned_in(frame):
    """The model that `keras.models.clone_model` is cloning when `frame`
    is its functional-clone function, else `None`."""
    if frame is None or frame.f_code is not _CLONE_FUNCTIONAL_CODE:
        return None
    return frame.f_locals.get("model")


# ---------------------------------------------------------------- variables
# `keras.Variable(synchronization=...)` exists from Keras 3.10 on; before,
# the TF backend's variable creates its `tf.Variable` in `_initialize`
# without it.
_VARIABLE_HAS_SYNCHRONIZATION = (
    "synchronization" in inspect.signature(keras.Variable.__init__).parameters
)


def variable(initializer, *, synchronization="auto", **kwargs):
    """`keras.Variable(initializer, synchronization=..., **kwargs)` on every
    supported Keras (`synchronization="on_read"`: per-replica values,
    reduced by the variable's `aggregation` when read in cross-replica
    context)."""
    if synchronization == "auto":
        return keras.Variable(initializer, **kwargs)
    if _VARIABLE_HAS_SYNCHRONIZATION:
        return keras.Variable(initializer, synchronization=synchronization, **kwargs)
    # Keras < 3.10 (TensorFlow only: the synchronization is `tf.distribute`'s).
    from keras_fastgrad._compat.tensorflow import SynchronizedVariable

    return SynchronizedVariable(initializer, synchronization=synchronization, **kwargs)


# ---------------------------------------------------------- pickle, frames


def unpickle_model_function(cls):
    """What Keras' `Model.__reduce__` names to rebuild a pickled model."""
    return cls._unpickle_model


def caller_frame(depth):
    """The frame `depth` calls up from the caller (CPython's
    `sys._getframe`)."""
    return sys._getframe(depth + 1)


# ---------------------------------------------------------------- callbacks
# `fit` builds its `keras.callbacks.CallbackList` (the user's callbacks,
# then the `History` and `ProgbarLogger` it adds) and only then calls each
# callback's `set_model` from `CallbackList.set_model`: a callback finds the
# list, which it is never given, in that frame (the public class's own code).
_CALLBACK_LIST_SET_MODEL_CODE = keras.callbacks.CallbackList.set_model.__code__


def calling_callback_list(max_depth=8):
    """The `keras.callbacks.CallbackList` whose `set_model` is running up to
    `max_depth` calls above the caller, else `None`."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code is _CALLBACK_LIST_SET_MODEL_CODE:
            return frame.f_locals.get("self")
    return None


# ------------------------------------------------------- functional graph
# How a functional model's tensors were made (the features space finds the
# shared representation by walking them).


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a symbolic tensor."""
    return tensor._keras_history


def parent_tensors(tensor):
    """The input tensors of the call that produced `tensor`."""
    operation, node_index, _ = tensor._keras_history
    return operation._inbound_nodes[node_index].input_tensors


def nodes_by_depth(model):
    """A functional model's `{depth: [node, ...]}`."""
    return model._nodes_by_depth


# ------------------------------------------------------------------ canary
# Every private name above (and the BatchNorm recorder's, in
# `keras_fastgrad.step.batchnorm_recording`), as (owner, attribute): checked
# by `tests/test_compat.py`, with `tensorflow.TENSORFLOW_PRIVATE_NAMES`.
# Instance attributes set by `compile`
# (`_loss_tracker`, `_compile_loss`) and by `CompileLoss.__init__`
# (`_flat_losses`, `_user_loss`) are checked on a compiled model there.
KERAS_PRIVATE_NAMES = (
    ("keras.src.backend", "compute_output_spec"),
    ("keras.src.backend.common.masking", "get_keras_mask"),
    ("keras.src.backend.common.masking", "set_keras_mask"),
    ("keras.src.losses.loss", "apply_mask"),
    ("keras.src.losses.loss", "reduce_weighted_values"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    ("keras.src.models.cloning", "_clone_functional_model"),
    ("keras.src.models.functional", "Functional"),
    ("keras.src.models.model", "functional_init_arguments"),
    ("keras.src.saving.object_registration", "GLOBAL_CUSTOM_NAMES"),
    ("keras.src.saving.keras_saveable", "KerasSaveable"),
    ("keras.src.trainers.trainer", "Trainer"),
    ("keras.src.backend.common.symbolic_scope", "in_symbolic_scope"),
    ("keras.src.utils.python_utils", "default"),
    ("keras.src.utils.python_utils", "is_default"),
    ("keras.Model", "_call_has_training_arg"),
    ("keras.Model", "_compute_loss"),
    ("keras.Model", "_aggregate_additional_loss"),
    ("keras.Model", "_symbolic_build"),
    ("keras.Model", "_flatten_layers"),
    ("keras.Model", "_get_own_losses"),
    ("keras.Model", "_loss_ids"),
    ("keras.Model", "_losses_override"),
    ("keras.layers.BatchNormalization", "_moments"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_distribute_strategy"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_compile_metrics"),
    ("keras.Model", "_unpickle_model"),
    ("Functional", "_nodes_by_depth"),
    ("KerasTensor", "_keras_history"),
    ("keras.Operation", "_inbound_nodes"),
    ("CompileLoss", "_flat_losses"),
    ("CompileLoss", "_user_loss"),
)
