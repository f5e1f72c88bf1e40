"""The base class of the multi-task aggregators and what their modules
share (`aggregators.py` and the newer methods' own modules import it).

Written in `keras.ops`: the same aggregators on Keras' TensorFlow and JAX
backends (a Gram matrix may be a TensorFlow tensor, a JAX array or NumPy)."""

import keras
from keras import ops

_PACKAGE = "keras_fastgrad"


class Aggregator:
    """Base: maps the Gram matrix of task gradients to task weights.

    Subclasses implement `_weights(gram)`; `weights` checks the
    input and computes half precision in float32. Pass an instance as
    `FastGradModel(multitask=...)`; register it with
    `keras.saving.register_keras_serializable` so `.keras` files load.

    Example:

    >>> from keras import ops
    >>> class FirstTaskOnly(Aggregator):
    ...     name = "first_task_only"
    ...     def _weights(self, gram):
    ...         return ops.one_hot(0, gram.shape[0], dtype=gram.dtype)
    >>> ops.convert_to_numpy(FirstTaskOnly().weights(ops.eye(3))).tolist()
    [1.0, 0.0, 0.0]
    """

    name = None

    def weights(self, gram):
        """Task weights `w` (`[T]`) such that the merged gradient is `w^T J`.

        Args:
            gram: `[T, T]` Gram matrix `J J^T` of the task gradients, with a
                static `T`.

        Returns:
            `[T]` weights, in the dtype of `gram`.
        """
        return self._run(gram, self._weights)

    def _run(self, gram, fn):
        gram = _check_gram(gram)
        dtype = keras.backend.standardize_dtype(gram.dtype)
        if dtype in ("float16", "bfloat16"):
            gram = ops.cast(gram, "float32")
        return ops.cast(fn(gram), dtype)

    def _weights(self, gram):
        raise NotImplementedError

    # Optional state (e.g. GradVac's EMA targets). `TaskMerger` calls
    # `build` once the task count is known, merges with the weights of
    # `weights_and_state` and assigns the new state only when the merged
    # gradient is finite. Stateless aggregators keep these defaults.
    def build(self, num_tasks):
        """Creates the state variables for `num_tasks` tasks (none here)."""

    @property
    def state_variables(self):
        """The state variables (a list, empty for stateless aggregators)."""
        return []

    def weights_and_state(self, gram):
        """`(weights, new_state)`: `new_state` aligns with `state_variables`."""
        return self.weights(gram), []

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _register(cls):
    return keras.saving.register_keras_serializable(package=_PACKAGE)(cls)


def _check_gram(gram):
    gram = ops.convert_to_tensor(gram)
    if not keras.backend.is_float_dtype(gram.dtype):
        gram = ops.cast(gram, keras.backend.floatx())
    shape = tuple(gram.shape)
    if len(shape) != 2 or shape[0] is None or shape[0] != shape[1] or shape[0] < 1:
        raise ValueError(
            "`gram` must be a square matrix of shape (T, T) with a static "
            f"number of tasks T >= 1. Received: gram.shape={shape}"
        )
    return gram
