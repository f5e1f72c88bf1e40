"""Where `FastGradModel` meets Keras' own machinery: the work behind the
Keras hooks it overrides (each override in `model.py` is a few lines that
call one function here):

- `__new__`: the functional form gets its own class (`functional_variant`)
  instead of Keras rewriting the class's bases; a clone made by
  `keras.models.clone_model` gets the original's options
  (`cloned_options`).
- `_maybe_symbolic_build`: the step's state needs the variables (also those
  only `training=True` creates) before the first trace; and under
  MultiWorkerMirroredStrategy Keras' own version fails (`builds_itself`,
  `build_for_training`).
- `_get_metrics_result_or_logs`: right after an epoch's last batch and
  before validation, the place to apply a partial accumulation window
  (`with_flushed`).

Nothing here imports `model.py`: the functions get the model (and, where
they need it, the class) as arguments.
"""

import keras
from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf


# ------------------------------------------------------------- __new__
def is_functional_call(cls, args, kwargs):
    """Whether `cls(*args, **kwargs)` builds a functional model (as Keras
    decides it; a `Sequential` never is one)."""
    return compat.functional_init_arguments(args, kwargs) and not issubclass(cls, keras.Sequential)


def cloned_options(frame, base):
    """The options of the model `keras.models.clone_model` is cloning, if
    the model under construction is that clone (and the original a `base`
    instance), else `None`.

    Args:
        frame: The frame that called the class (`__new__`'s caller).
        base: The class whose instances carry options (`FastGradModel`).
    """
    # A subclass that overrides `__new__` sits between the caller and here.
    while frame is not None and frame.f_code.co_name == "__new__":
        frame = frame.f_back
    # `keras.models.clone_model` builds a functional clone as
    # `model.__class__(inputs, outputs, name=model.name)`: no options, and
    # no hook that would let the class pass them on.
    model = compat.model_cloned_in(frame)
    return model._fg_options() if isinstance(model, base) else None


_FUNCTIONAL_VARIANTS = {}


def is_functional_init(model, args, kwargs):
    """Whether `model.__init__` got the functional form (`Model(inputs,
    outputs)`), which `init_functional` runs (a `keras.Sequential` runs
    its own)."""
    functional = compat.functional_init_arguments(args, kwargs)
    return functional and not isinstance(model, keras.Sequential)


def init_functional(model, args, kwargs):
    """What `keras.Model.__init__` does for the functional form, without
    injecting `Functional` into the class's bases (which would break later
    subclassed uses of `FastGradModel`)."""
    if not isinstance(model, compat.Functional):
        # `super().__init__(inputs=..., outputs=...)` from a subclass's
        # `__init__`: Keras would rewrite the bases of every class up to
        # `keras.Model` (and so break every later subclassed
        # `FastGradModel`); this instance gets the class's functional
        # variant instead.
        model.__class__ = functional_variant(type(model))
    compat.init_functional(model, args, kwargs)


def functional_variant(cls):
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
            {
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
                "__qualname__": cls.__qualname__,
            },
        )
        # Serialized under the class's registered name: a `.keras` file names
        # the user's class, and loading it comes back here.
        compat.serialize_as(variant, keras.saving.get_registered_name(cls))
        _FUNCTIONAL_VARIANTS[cls] = variant
    return variant


# --------------------------------------------------- compile_from_config
def compile_from_config(model, config):
    """Keras skips recompiling a loaded model whose `compile` is
    overridden; ours keeps Keras' signature, so recompile."""
    model.compile(**keras.saving.deserialize_keras_object(config))
    if model.built:
        model.optimizer.build(model.trainable_variables)


# -------------------------------------------------- _maybe_symbolic_build
def builds_itself(model):
    """Whether the model needs `build_for_training` before training rather
    than Keras' `_maybe_symbolic_build`: under a strategy of its own,
    unbuilt, or never trained with a layer still unbuilt. The step's state
    and the optimizer must exist, for the variables a training call
    creates, before the train function is traced."""
    return (
        compat.own_distribute_strategy(model) is not None
        or not model.built
        or _first_training(model)
    )


def _first_training(model):
    """Compiled, never trained, and some layer not built yet (once every
    layer is built, a functional model say, a training call has no
    variable left to create)."""
    optimizer = getattr(model, "optimizer", None)
    return (
        optimizer is not None
        and not optimizer.built
        and not all(layer.built for layer in compat.flatten_layers(model))
    )


def build_for_training(model, iterator=None, data_batch=None):
    """Builds `model` (and the variables of a training call) from the
    batches' structure, shapes and dtypes, symbolically: no weight, moving
    statistic or seed moves, and no data is read (`_batch_structure`).
    When `run_eagerly`, `call` may hold eager-only Python: built by calling
    it (`_build_eagerly`)."""
    first_training = _first_training(model)
    strategy = model.distribute_strategy
    if iterator is not None:
        data_batch = _batch_structure(model, iterator)
    eager = compat.own_distribute_strategy(model) is None and model.run_eagerly
    with strategy.scope():
        training_built = first_training and _build_training_variables(
            model, data_batch, quiet=eager
        )
        if eager and not training_built:
            _build_eagerly(model, data_batch)
        elif not eager:
            compat.symbolic_build(model, data_batch)


def build_from_the_first_call(model, data_iterator):
    """`build_for_training` from the data iterator a TensorFlow train
    function is called with (its `element_spec`: no batch read). For a
    plain model that the callbacks attach to (`attachment.attach`): its `fit`
    ran Keras' `_maybe_symbolic_build`, which builds nothing without a
    strategy (Keras leaves it to the first trace), and the step's state
    and optimizer must be built for the model's variables before it is
    traced."""
    spec = tree.map_structure(lambda s: None if _is_absent(s) else s, data_iterator.element_spec)
    build_for_training(model, data_batch=spec)


def _batch_structure(model, iterator):
    """What the build needs of `fit`'s data (structure, shapes, dtypes),
    read as `keras.Model.fit` would: without a strategy Keras reads no
    batch before training, so neither do we (the dataset's `element_spec`:
    reading a batch would start an epoch of the data, run a shuffle and a
    `PyDataset.on_epoch_end` more than Keras, and lose batches of a
    generator). Under a strategy Keras reads the first batch (and so moves
    the data on); we read it the same way."""
    spec = None
    if compat.own_distribute_strategy(model) is None:
        spec = compat.batch_spec(iterator)
    if spec is not None and all(
        _is_absent(s) or s.shape.rank is not None for s in tree.flatten(spec)
    ):
        return tree.map_structure(lambda s: None if _is_absent(s) else s, spec)
    # Under a strategy, Keras averages one distributed batch with
    # `strategy.reduce`, which `MultiWorkerMirroredStrategy` cannot do
    # eagerly (plain `keras.Model.fit` fails there); the build only needs
    # the batch's structure, shapes and dtypes: replica 0's part has them.
    strategy = model.distribute_strategy
    return tree.map_structure(
        lambda v: (
            strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v
        ),
        compat.first_batch(iterator),
    )


def _is_absent(spec):
    """An entry of a generator's batches that is `None` (`tf.data` holds it
    as an empty `Optional`)."""
    return isinstance(spec, tf.OptionalSpec)


def _build_training_variables(model, data_batch, quiet):
    """Creates the variables of `call(x, training=True)` with a symbolic
    forward pass. Returns whether it ran; when it fails and `quiet` (an
    eager-only `call`), returns `False` instead of raising."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
    x = tree.map_structure(
        lambda v: (
            None
            if v is None
            else keras.KerasTensor(v.shape, keras.backend.standardize_dtype(v.dtype))
        ),
        x,
    )
    kwargs = {"training": True} if compat.call_has_training_arg(model) else {}
    try:
        compat.compute_output_spec(model, x, **kwargs)
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


def _build_eagerly(model, data_batch):
    """Builds an unbuilt `run_eagerly` model by calling it on the batch (on
    zeros of its shapes when only those are known), with `training=False` (no moving statistic or seed moves), as Keras'
    symbolic build does but eagerly: its `call` may hold eager-only Python
    (`float(tensor)`, `.numpy()`). Variables that only `training=True`
    creates are then not built before the first step."""
    if all(layer.built for layer in compat.flatten_layers(model)):
        return  # (`model.build(shape)` may have left layers unbuilt)
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
    x = tree.map_structure(_placeholder_value, x)
    kwargs = {"training": False} if compat.call_has_training_arg(model) else {}
    model(x, **kwargs)


def _placeholder_value(value):
    """A batch entry given as a `tf.TensorSpec` (no data read): zeros (or
    empty strings) of its shape, with 1 for a dimension it leaves open."""
    if not isinstance(value, tf.TensorSpec):
        return value
    shape = [1 if d is None else d for d in value.shape.as_list()]
    if value.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, value.dtype)


# ---------------------------------------------- _get_metrics_result_or_logs
def with_flushed(model, logs):
    """The epoch's logs after applying a partial accumulation window (the
    flush's telemetry replaces the keys it measured), inside `fit` only:
    `evaluate` ends with the same Keras hook."""
    state = model.fastgrad_step_state
    if not state.in_fit or state.evaluating:
        return logs
    flushed = model.apply_partial_window()
    if flushed is not None and isinstance(logs, dict):
        logs = {**logs, **{k: flushed[k] for k in logs if k in flushed}}
    return logs
