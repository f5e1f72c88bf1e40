"""The base class of the multi-task aggregators and what their modules
share (`aggregators.py` and the newer methods' own modules import it)."""

import keras
import tensorflow as tf

_PACKAGE = "keras_fastgrad"


class Aggregator:
    """Base: maps the Gram matrix of task gradients to task weights.

    Subclasses implement `_weights(gram)`; `weights` checks the
    input and computes half precision in float32. Pass an instance as
    `FastGradModel(multitask=...)`; register it with
    `keras.saving.register_keras_serializable` so `.keras` files load.

    Example:

    >>> class FirstTaskOnly(Aggregator):
    ...     name = "first_task_only"
    ...     def _weights(self, gram):
    ...         return tf.one_hot(0, gram.shape[0], dtype=gram.dtype)
    >>> FirstTaskOnly().weights(tf.eye(3)).numpy().tolist()
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
        dtype = gram.dtype
        if dtype in (tf.float16, tf.bfloat16):
            gram = tf.cast(gram, tf.float32)
        return tf.cast(fn(gram), dtype)

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
    gram = tf.convert_to_tensor(gram)
    if not gram.dtype.is_floating:
        gram = tf.cast(gram, keras.backend.floatx())
    shape = gram.shape
    if shape.rank != 2 or shape[0] is None or shape[0] != shape[1] or shape[0] < 1:
        raise ValueError(
            "`gram` must be a square matrix of shape (T, T) with a static "
            f"number of tasks T >= 1. Received: gram.shape={shape}"
        )
    return gram
