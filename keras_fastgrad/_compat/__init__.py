"""The one seam between keras_fastgrad and Keras', TensorFlow's and JAX's
private API, one module per library it bridges.

Every use of a name that Keras, TensorFlow or JAX does not export
(`keras.src`, `_`-prefixed attributes, TF strategy internals) lives in this
package, behind a small named function or alias; the rest of the package
imports only `keras_fastgrad._compat` (every name is re-exported here) and
the public API (`keras.tree`, `keras.saving`, ...). Where Keras releases
differ (supported: Keras >= 3.8 with TensorFlow >= 2.18) the version branch
is here too.

- `keras.py`: Keras' private members (model, trainer, `CompileLoss`,
  saving, cloning, callbacks, the functional graph, `BatchNormalization`'s
  `_moments`); imports neither TensorFlow nor JAX.
- `tensorflow.py`: `tf.distribute` internals, the XLA context, `tf.data`
  specs, a variable's `synchronization` before Keras 3.10. Imported here
  on Keras' TensorFlow backend only; on JAX, only where one of its names is
  asked for (`__getattr__` below).
- `jax.py`: Keras' JAX trainer's private members and `jax.jit`'s cache;
  imports no backend.

`tests/test_compat.py` is the canary: it checks that every name in
`PRIVATE_NAMES` (and every private method the package overrides,
`OVERRIDDEN_PRIVATE_METHODS`) still exists in the installed Keras and
TensorFlow, with the arguments we pass, and that no other module of the
package imports `keras.src` or `tensorflow.python`; under
`KERAS_BACKEND=jax`, `tests/test_compat_jax.py` checks
`JAX_PRIVATE_NAMES`. A Keras upgrade that moves one of them fails there, in
one place.
"""

import keras as _keras_api

from keras_fastgrad._compat.jax import (  # noqa: F401
    JAX_PRIVATE_NAMES,
    JAX_STATE_METHODS,
    attached_values,
    jit_cache_size,
    reattach,
)
from keras_fastgrad._compat.keras import (  # noqa: F401
    _CLONE_FUNCTIONAL_CODE,
    _VARIABLE_HAS_SYNCHRONIZATION,
    KERAS_PRIVATE_NAMES,
    KERAS_VERSION,
    MIN_KERAS_VERSION,
    MULTI_REPLICA_SUPPORTED,
    OVERRIDDEN_PRIVATE_METHODS,
    SAVEABLE_OBJ_TYPE,
    Functional,
    KerasSaveable,
    Trainer,
    additional_loss,
    apply_mask,
    batchnorm_moments,
    call_has_training_arg,
    caller_frame,
    calling_callback_list,
    compile_loss,
    compute_loss,
    compute_loss_function,
    compute_output_spec,
    first_batch,
    flatten_layers,
    forward_losses,
    functional_init_arguments,
    get_keras_mask,
    has_own_losses,
    in_symbolic_scope,
    init_functional,
    is_keras_default,
    keras_default,
    keras_history,
    last_batch,
    loss_tracker,
    losses_overridden,
    model_cloned_in,
    nodes_by_depth,
    once_built,
    output_loss_metrics,
    output_losses,
    own_distribute_strategy,
    own_losses,
    parent_tensors,
    reduce_weighted_values,
    serialize_as,
    set_batchnorm_moments,
    set_keras_mask,
    set_loss_tracker,
    set_output_losses,
    symbolic_build,
    unpickle_model_function,
    unscale_loss_for_distribution,
    update_compiled_metrics,
    user_loss,
    variable,
    with_default_mark,
)

# The names of `tensorflow.py`, re-exported here.
_TENSORFLOW_NAMES = (
    "PRIVATE_NAMES",
    "SynchronizedVariable",
    "TENSORFLOW_PRIVATE_NAMES",
    "batch_spec",
    "direct_merge_calls",
    "in_multi_worker_mode",
    "in_xla_context",
    "is_default_strategy",
)
# Moved to the BatchNorm unit; still reached as `_compat.batchnorm_recording`.
_MOVED = {"batchnorm_recording": "keras_fastgrad.step.batchnorm_recording"}

if _keras_api.backend.backend() == "tensorflow":
    from keras_fastgrad._compat.tensorflow import (  # noqa: F401
        TENSORFLOW_PRIVATE_NAMES,
        SynchronizedVariable,
        batch_spec,
        direct_merge_calls,
        in_multi_worker_mode,
        in_xla_context,
        is_default_strategy,
    )

    # Every private name of Keras and TensorFlow, as (owner, attribute).
    PRIVATE_NAMES = KERAS_PRIVATE_NAMES + TENSORFLOW_PRIVATE_NAMES


def __getattr__(name):
    # On JAX, the TensorFlow bridge where one of its names is asked for
    # (it names TensorFlow through `_tf_startup.tf`: imported only when used);
    # on either backend, the names that moved.
    import importlib

    if name in _TENSORFLOW_NAMES:
        from keras_fastgrad._compat import tensorflow

        if name == "PRIVATE_NAMES":
            return KERAS_PRIVATE_NAMES + tensorflow.TENSORFLOW_PRIVATE_NAMES
        return getattr(tensorflow, name)
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compiled(fn, static_argnames=()):
    """`fn` traced once per input signature and run as one program, eager
    too, inlined in a traced step: `jax.jit` with `static_argnames` (the
    Python arguments) on Keras' JAX backend, `tf.function(autograph=False)`
    on TensorFlow (Python arguments retrace)."""
    if _keras_api.backend.backend() == "jax":
        import jax

        return jax.jit(fn, static_argnames=static_argnames)
    from keras_fastgrad._tf_startup import tf

    return tf.function(fn, autograph=False)
