"""The projection onto the dual cone of the task gradients, shared by
UPGrad and DualProj: `min_v v^T G v  s.t.  v >= u` (Quinton & Rey 2024,
Proposition 1), solved exactly by the active-set QP (`qp.py`)."""

import warnings

from keras import ops

from keras_fastgrad._validation import check_int, check_number
from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.numerics import _compiled, _finite_or_nan
from keras_fastgrad.aggregators._utils.qp import active_set_qp


def dual_cone_weights(gram, targets):
    """Row `k`: `v = argmin v^T G v  s.t.  v >= targets[k]`, exactly.

    `J^T v` is then the projection of `J^T targets[k]` onto the dual cone
    of the rows of `J`. Solved to its KKT conditions (`v >= u`,
    `(G v)_i >= 0` where `v_i = u_i`, `(G v)_i = 0` elsewhere) by the
    active-set method of `_qp.active_set_qp`; a zero gradient
    (`G_ii = 0`) keeps `v_i = u_i`.

    Args:
        gram: `[T, T]` positive semi-definite float tensor, finite.
        targets: `[K, T]` float tensor, one `u` per row.

    Returns:
        `[K, T]` tensor `V`.
    """
    return active_set_qp(gram, targets)[0]


def normalized_regularized(gram, norm_eps, reg_eps):
    """torchjd's `regularize(normalize(G, norm_eps), reg_eps)`: `G / trace G`
    (zeros when `trace G < norm_eps`), plus `reg_eps I`.

    Decision: a zero trace also gives zeros when `norm_eps = 0` (torchjd
    divides 0 by 0), and the trace is summed as `m sum(diag(G) / m)`,
    `m = max(diag G)`, so that a float32 Gram near the top of its range does
    not overflow to `inf` (and `G` to 0).
    """
    top = ops.max(ops.diagonal(gram))
    top = ops.where(top > 0, top, ops.ones_like(top))
    scaled = gram / top
    trace = ops.trace(scaled)
    small = (trace * top < norm_eps) | (trace <= 0)
    gram = ops.where(
        small, ops.zeros_like(gram), scaled / ops.where(small, ops.ones_like(trace), trace)
    )
    return gram + reg_eps * ops.eye(gram.shape[0], dtype=gram.dtype)


@_compiled(static_argnames=("targets",))
def projected_weights(gram, targets, norm_eps, reg_eps):
    """UPGrad's or DualProj's weights: `sum_k v(u_k)`, `v(u)` the dual-cone
    weights of `u` on the normalised and regularised `G`.

    One compiled program for the whole computation (on JAX each op run
    eagerly would compile on its own); under `jax.jit` the options are
    traced, so that they do not make programs of their own.

    Args:
        gram: `[T, T]` positive semi-definite float tensor.
        targets: `"each"`, the rows `u_k = e_k / T` (UPGrad), or `"mean"`,
            the one row `u = 1/T` (DualProj).
        norm_eps: float, as `normalized_regularized`.
        reg_eps: float, as `normalized_regularized`.

    Returns:
        `[T]` weights, NaN where `gram` is not finite.
    """
    num_tasks, dtype = gram.shape[0], gram.dtype
    if targets == "each":
        u = ops.eye(num_tasks, dtype=dtype) / num_tasks
    else:
        u = ops.full([1, num_tasks], 1.0 / num_tasks, dtype=dtype)

    def solve(g):
        return ops.sum(dual_cone_weights(normalized_regularized(g, norm_eps, reg_eps), u), 0)

    return _finite_or_nan(gram, solve)


class _DualCone(aggregators.Aggregator):
    """Shared options of UPGrad and DualProj.

    Decision: `max_iter` (the cap on the coordinate-descent sweeps of
    versions up to 0.x, saved in their configs) is deprecated and ignored:
    the QP is now solved exactly (`dual_cone_weights`). It is still
    accepted, so `.keras` files saved with it load (silently, through
    `from_config`); passing it to the constructor warns.
    """

    def __init__(self, norm_eps=1e-4, reg_eps=1e-4, max_iter=None):
        self.norm_eps = check_number("norm_eps", norm_eps)
        self.reg_eps = check_number("reg_eps", reg_eps)
        if max_iter is not None:
            check_int("max_iter", max_iter, 1)
            warnings.warn(
                f"`max_iter` is deprecated and ignored by {type(self).__name__}: the "
                f"quadratic program is solved exactly. Received: max_iter={max_iter}. "
                "Fix: leave it out.",
                DeprecationWarning,
                stacklevel=2,
            )

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config.pop("max_iter", None)  # saved by earlier versions; ignored
        return cls(**config)

    _targets = None  # "each" (UPGrad) or "mean" (DualProj)

    def _weights(self, gram):
        return projected_weights(gram, self._targets, self.norm_eps, self.reg_eps)

    def get_config(self):
        return {"norm_eps": self.norm_eps, "reg_eps": self.reg_eps}
