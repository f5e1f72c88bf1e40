"""Aligned-MTL (Senushkin et al., CVPR 2023): the task gradients made
orthogonal with equal norms (the condition number of their Gram is 1)."""

import tensorflow as tf

from keras_fastgrad.aggregators._base import Aggregator, _check_gram, _register
from keras_fastgrad.aggregators._utils.numerics import (
    _RANK_EPS,
)


@_register
class AlignedMTL(Aggregator):
    """Aligned-MTL (Senushkin et al., CVPR 2023).

    "Independent Component Alignment for Multi-Task Learning":
    `G = V L V^T`, `B = sqrt(l_min) V L^{-1/2} V^T` over the non-zero
    eigenvalues (the official rank rule: `> max(L) T eps_float32`), `l_min`
    the smallest of them; `w = B omega` with the task
    pre-weights `omega` (ones, as the official `AlignedMTLBalancer`, which
    sums the aligned gradients). The aligned gradients `J^T B` are
    orthogonal with equal norms (`B G B = l_min I` at full rank). A
    non-finite `G` (a NaN sample) gives NaN weights, never an `eigh` error,
    so the train step's finite check drops the micro-batch.

    Args:
        task_weights: None (ones) or a list of `T` floats, `omega`.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> AlignedMTL().weights(gram).numpy().round(4).tolist()
    [0.5, 1.0]
    >>> AlignedMTL().weights([[float("nan"), 0.0], [0.0, 1.0]]).numpy().tolist()
    [nan, nan]
    """

    name = "aligned"

    def __init__(self, task_weights=None):
        if task_weights is not None:
            task_weights = [float(x) for x in task_weights]
        self.task_weights = task_weights

    def balance_matrix(self, gram):
        """The `[T, T]` matrix `B`: the aligned task gradients are `B^T J`."""
        return aligned_balance_matrix(_check_gram(gram))

    def _weights(self, gram):
        omega = tf.ones([gram.shape[0]], gram.dtype)
        if self.task_weights is not None:
            if len(self.task_weights) != gram.shape[0]:
                raise ValueError(
                    "`task_weights` must have one entry per task. Received: "
                    f"task_weights={self.task_weights} for {gram.shape[0]} tasks"
                )
            omega = tf.constant(self.task_weights, gram.dtype)
        return tf.linalg.matvec(aligned_balance_matrix(gram), omega)

    def get_config(self):
        return {"task_weights": self.task_weights}


def aligned_balance_matrix(gram):
    """Aligned-MTL balance matrix `B = sqrt(l_min) V L^{-1/2} V^T`.

    `G = V L V^T` (`tf.linalg.eigh`); eigenvalues `<= max(L) T eps_float32` are
    dropped (the rank rule of the official `ProcrustesSolver`) and `l_min` is
    the smallest kept one. Then `B G B = l_min P` (`P` the projector on the
    kept eigenspace): the aligned task gradients `J^T B` are orthogonal with
    equal norms `sqrt(l_min)`. A zero `G` gives `B = 0`; a non-finite `G`
    gives `B = NaN` (without calling `eigh` on it).
    """
    gram = tf.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    # `eigh` raises on NaN/Inf on CPU (outside XLA): decompose a finite
    # stand-in and return NaN, so the step's finite check drops the batch.
    finite = tf.reduce_all(tf.math.is_finite(gram))
    lam, vec = tf.linalg.eigh(tf.where(finite, gram, tf.eye(num_tasks, dtype=dtype)))
    keep = lam > tf.reduce_max(lam) * num_tasks * _RANK_EPS
    lam_safe = tf.where(keep, lam, 1.0)
    lam_min = tf.reduce_min(tf.where(keep, lam, tf.constant(float("inf"), dtype)))
    any_kept = tf.reduce_any(keep)
    scale = tf.where(any_kept, tf.sqrt(tf.where(any_kept, lam_min, 1.0)), 0.0)
    inv_sqrt = tf.where(keep, tf.math.rsqrt(lam_safe), 0.0)
    balance = scale * tf.matmul(vec * inv_sqrt[None, :], vec, transpose_b=True)
    return tf.where(finite, balance, tf.constant(float("nan"), dtype))
