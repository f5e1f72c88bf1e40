"""Nash-MTL: the Nash bargaining solution of the tasks' gradients.

Navon et al., "Multi-Task Learning as a Bargaining Game" (ICML 2022): the
update `sum_i alpha_i g_i` with `alpha > 0` solving `G alpha = 1 / alpha`
(elementwise), i.e. every task gets `alpha_i <g_i, update> = 1`. That
`alpha` is the unique minimiser of the strictly convex, self-concordant
`f(alpha) = alpha^T G alpha / 2 - sum_i log(alpha_i)` (its gradient is
`G alpha - 1/alpha`), found here by damped Newton steps in-graph where the
official code runs a sequence of convex programs with cvxpy/ECOS.
"""

import numpy as np
from keras import ops

from keras_fastgrad._validation import check_int, check_number
from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.numerics import (
    _compiled,
    _dtype,
    _eps,
    _finite_or_nan,
    _tiny,
)


@_compiled(static_argnames=("reg_eps", "max_iter"))
def nash_weights(gram, reg_eps=1e-6, max_iter=50):
    """`alpha > 0` with `(G_n + reg_eps I) alpha = 1 / alpha`, `G_n = G / ||G||_F`.

    The official code divides `G` by its Frobenius norm before solving (the
    weights then do not depend on the gradients' scale) and applies
    `alpha` to the unnormalised gradients; so does this function. A task
    whose gradient is zero (`G_ii <= T eps(dtype) max(diag G)`) gets weight
    0 and is left out of the solve (its gradient adds nothing whatever its
    weight); `G = 0` gives all zeros. `reg_eps` (relative to the
    normalised `G`) keeps `alpha` bounded when no positive solution exists
    (e.g. two opposite gradients).

    Decision: the ridge is at least `eps(dtype)` (so `reg_eps=0` means
    `eps`): without a solution the exact `alpha` is unbounded and the
    Newton system turned singular (an `InvalidArgumentError` on CPU);
    `alpha` now stays below about `1 / sqrt(eps)`. The Frobenius norm is
    taken of `G / max|G_ij|`, so a float32 Gram with entries near `1e20`
    (whose squares overflow) gives the same weights as any other scale.

    Newton on `f` from `alpha_i = 1 / sqrt(G_ii)`: the step
    `d = -(G + diag(1/alpha^2))^-1 (G alpha - 1/alpha)` is taken in full
    once the Newton decrement `lambda = sqrt(-grad^T d)` is below 1/4, and
    scaled by `1 / (1 + lambda)` before (the damped phase of Newton's
    method for self-concordant functions: every iterate stays positive).
    At most `max_iter` steps; stops once `max_i |alpha_i (G alpha)_i - 1|`
    is below `64 T eps(dtype)`.

    Args:
        gram: `[T, T]` float tensor.
        reg_eps: float >= 0, the ridge added to the normalised `G`.
        max_iter: int, the cap on the Newton steps.

    Returns:
        `[T]` task weights.
    """
    num_tasks, dtype = gram.shape[0], _dtype(gram.dtype)
    eye = np.eye(num_tasks, dtype=dtype)
    # ||G||_F = m ||G / m||_F, m = max |G_ij|: no overflow of the squares.
    top = ops.max(ops.abs(gram))
    empty = top <= 0
    gram = gram / ops.where(empty, 1.0, top)
    gram = gram / ops.where(empty, 1.0, ops.sqrt(ops.sum(gram * gram)))
    diag = ops.diagonal(gram)
    active = diag > num_tasks * _eps(dtype) * ops.max(diag)
    mask = ops.cast(active, dtype)
    # Zero tasks decouple (their own unit diagonal) and are zeroed at the end.
    system = gram * mask[:, None] * mask[None, :] + eye * (1.0 - mask)
    system = system + ops.maximum(ops.cast(reg_eps, dtype), _eps(dtype)) * eye
    tol = 64.0 * num_tasks * _eps(dtype)

    def body(i, alpha, done):
        g_alpha = ops.matmul(system, alpha)
        grad = g_alpha - 1.0 / alpha
        hessian = system + ops.diag(1.0 / ops.square(alpha))
        step = -ops.solve(hessian, grad)
        decrement = ops.sqrt(ops.maximum(-ops.sum(grad * step), 0.0))
        damping = ops.where(decrement < 0.25, 1.0, 1.0 / (1.0 + decrement))
        alpha = ops.maximum(alpha + damping * step, _tiny(dtype))
        residual = ops.max(ops.abs(alpha * ops.matmul(system, alpha) - 1.0))
        return i + 1, alpha, residual <= tol

    alpha0 = ops.rsqrt(ops.diagonal(system))
    _, alpha, _ = ops.while_loop(
        lambda i, alpha, done: (i < max_iter) & ops.logical_not(done),
        body,
        (ops.convert_to_tensor(0, "int32"), alpha0, ops.convert_to_tensor(False)),
        maximum_iterations=max_iter,
    )
    return ops.where(active & ops.logical_not(empty), alpha, 0.0)


@aggregators._register
class NashMTL(aggregators.Aggregator):
    """Nash-MTL (Navon et al., ICML 2022), "Multi-Task Learning as a Bargaining Game".

    Weights `alpha > 0` solving the bargaining condition
    `G_n alpha = 1 / alpha` (elementwise) on the Gram matrix normalised by
    its Frobenius norm, `G_n = G / ||G||_F`, as the official
    `NashMTL.get_weighted_loss`; `alpha` weighs the unnormalised task
    gradients. Solved exactly (not by the official sequence of convex
    programs, warm-started from the previous step) with damped Newton
    steps in-graph (`nash_weights`). Kept from the official code: the
    normalisation. Not kept: updating the weights only every
    `update_weights_every` steps, and the gradient-norm clipping of the
    shared parameters (`max_norm=1`; use `FastGradModel(clip_norm=1.0)`).
    A zero-gradient task gets weight 0; a small ridge `reg_eps` keeps the
    weights finite when the condition has no solution (opposite
    gradients). A non-finite `G` gives NaN weights.

    Args:
        reg_eps: float >= 0, the ridge added to the normalised `G` (at least
            `eps(dtype)`, see `nash_weights`).
        max_iter: int >= 1, the cap on the Newton steps.

    Example:

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> w = keras.ops.convert_to_numpy(NashMTL(reg_eps=0.0).weights(gram))
    >>> w.round(4).tolist()
    [1.0153, 2.0305]
    >>> g_n = gram / np.linalg.norm(gram)  # the bargaining condition G_n w = 1 / w
    >>> (g_n @ w * w).round(6).tolist()
    [1.0, 1.0]
    """

    name = "nashmtl"

    def __init__(self, reg_eps=1e-6, max_iter=50):
        self.reg_eps = check_number("reg_eps", reg_eps)
        self.max_iter = check_int("max_iter", max_iter, 1)

    def _weights(self, gram):
        return _finite_or_nan(gram, lambda g: nash_weights(g, self.reg_eps, self.max_iter))

    def get_config(self):
        return {"reg_eps": self.reg_eps, "max_iter": self.max_iter}
