"""Aligned-MTL (Senushkin et al., CVPR 2023): the task gradients made
orthogonal with equal norms (the condition number of their Gram is 1)."""

import numpy as np
from keras import ops

from keras_fastgrad.aggregators._base import Aggregator, _check_gram, _register
from keras_fastgrad.aggregators._utils.numerics import _RANK_EPS, _compiled, _dtype


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

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> keras.ops.convert_to_numpy(AlignedMTL().weights(gram)).round(4).tolist()
    [0.5, 1.0]
    >>> w = AlignedMTL().weights([[float("nan"), 0.0], [0.0, 1.0]])
    >>> keras.ops.convert_to_numpy(w).tolist()
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
        omega = np.ones([gram.shape[0]], _dtype(gram.dtype))
        if self.task_weights is not None:
            if len(self.task_weights) != gram.shape[0]:
                raise ValueError(
                    "`task_weights` must have one entry per task. Received: "
                    f"task_weights={self.task_weights} for {gram.shape[0]} tasks"
                )
            omega = np.array(self.task_weights, _dtype(gram.dtype))
        return ops.matmul(aligned_balance_matrix(gram), omega)

    def get_config(self):
        return {"task_weights": self.task_weights}


@_compiled()
def aligned_balance_matrix(gram):
    """Aligned-MTL balance matrix `B = sqrt(l_min) V L^{-1/2} V^T`.

    `G = V L V^T` (`ops.eigh`); eigenvalues `<= max(L) T eps_float32` are
    dropped (the rank rule of the official `ProcrustesSolver`) and `l_min` is
    the smallest kept one. Then `B G B = l_min P` (`P` the projector on the
    kept eigenspace): the aligned task gradients `J^T B` are orthogonal with
    equal norms `sqrt(l_min)`. A zero `G` gives `B = 0`; a non-finite `G`
    gives `B = NaN` (without calling `eigh` on it).
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], _dtype(gram.dtype)
    # `eigh` raises on NaN/Inf on CPU (outside XLA): decompose a finite
    # stand-in and return NaN, so the step's finite check drops the batch.
    finite = ops.all(ops.isfinite(gram))
    lam, vec = ops.eigh(ops.where(finite, gram, np.eye(num_tasks, dtype=dtype)))
    keep = lam > ops.max(lam) * num_tasks * _RANK_EPS
    lam_safe = ops.where(keep, lam, 1.0)
    lam_min = ops.min(ops.where(keep, lam, float("inf")))
    any_kept = ops.any(keep)
    scale = ops.where(any_kept, ops.sqrt(ops.where(any_kept, lam_min, 1.0)), 0.0)
    inv_sqrt = ops.where(keep, ops.rsqrt(lam_safe), 0.0)
    balance = scale * ops.matmul(vec * inv_sqrt[None, :], ops.transpose(vec))
    return ops.where(finite, balance, float("nan"))
