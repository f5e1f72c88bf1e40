"""CAGrad (Liu et al., NeurIPS 2021): conflict-averse gradient descent,
as the official code computes it."""

from keras import ops

from keras_fastgrad._validation import check_int
from keras_fastgrad.aggregators._base import Aggregator, _register
from keras_fastgrad.aggregators._utils.frank_wolfe import _pairwise_frank_wolfe
from keras_fastgrad.aggregators._utils.numerics import _compiled, _max_diag, _tiny


@_register
class CAGrad(Aggregator):
    """CAGrad (Liu et al., NeurIPS 2021).

    "Conflict-Averse Gradient Descent for Multi-task Learning", as the
    official `cagrad` function: `g0` the mean gradient,
    `c' = c ||g0|| + 1e-8`,
    `w = argmin_{w in simplex} w^T G 1/T + c' sqrt(w^T G w + 1e-8)`,
    `g = (g0 + c' / ||w^T J|| w^T J) / (1 + c^2)` (`rescale=1`; `rescale=2`
    divides by `1 + c`, `rescale=0` not at all). The simplex problem is
    solved in-graph (pairwise Frank-Wolfe, exact line search) instead of
    scipy's SLSQP. `c=0` gives the mean. Computed in units of
    `max(diag G)` with the official `1e-8` constants rescaled alike: the
    same weights, without overflow for float32 Grams up to `~1e36`
    (`cagrad_weights`).

    Args:
        c: float >= 0, the radius of the conflict-averse ball.
        rescale: 0, 1 or 2.
        max_iter: int, the cap on the solver steps.

    Example:

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> ops.convert_to_numpy(CAGrad(c=0.5).weights(gram)).round(4).tolist()
    [0.4, 0.8472]
    >>> ops.convert_to_numpy(CAGrad(c=0.0).weights(gram)).round(4).tolist()
    [0.5, 0.5]
    """

    name = "cagrad"

    def __init__(self, c=0.5, rescale=1, max_iter=1000):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0:
            raise ValueError(f"`c` must be a number >= 0. Received: c={c!r}")
        if rescale not in (0, 1, 2) or isinstance(rescale, bool):
            raise ValueError(f"`rescale` must be 0, 1 or 2. Received: rescale={rescale!r}")
        self.c, self.rescale = float(c), rescale
        self.max_iter = check_int("max_iter", max_iter, 1)

    def _weights(self, gram):
        return cagrad_weights(gram, self.c, self.rescale, self.max_iter)

    def get_config(self):
        return {"c": self.c, "rescale": self.rescale, "max_iter": self.max_iter}


@_compiled(static_argnames=("rescale", "max_iter"))
def cagrad_weights(gram, c=0.5, rescale=1, max_iter=1000):
    """CAGrad (Liu et al., 2021), the official `cagrad` function in Gram space.

    `g0_norm = sqrt(mean(G) + 1e-8)`, `c' = c g0_norm + 1e-8`,
    `w = argmin_{w in simplex} w^T G 1/T + c' sqrt(w^T G w + 1e-8)`,
    `lambda = c' / (||w^T J|| + 1e-8)`, `g = g0 + lambda w^T J`, divided by
    `1 + c^2` (`rescale=1`), `1 + c` (`rescale=2`) or 1 (`rescale=0`).
    Returns `(1/T + lambda w) / rescale_factor`.

    Decision: computed in units of `s = max(diag G)` (`G / s`, the
    constants `1e-8 / s` under square roots and `1e-8 / sqrt(s)` added to
    norms): exactly the official weights, but a float32 Gram with entries
    up to `1e36` no longer overflows to NaN. CAGrad is not scale-invariant:
    where `G` is not large against `1e-8` the constants change the weights,
    exactly as in the official code (e.g. `lambda = c' / (||w^T J|| +
    1e-8)` grows without bound as the gradients vanish); where it is, the
    weights do not depend on the scale.

    The line search along `d` is exact: with `y = a gamma + b`,
    `a = d^T G d`, `b = d^T G w`, `q0 = w^T G w + 1e-8`, `K = a q0 - b^2` and
    `r = -(d^T G 1/T) / c'`, the objective is stationary at
    `y = r sqrt(K / (a - r^2))` when `r^2 < a`, and monotone otherwise.
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    # In units of s = max(diag G): G_n = G / s, and the official constants
    # become delta / s (under the square roots) and delta / sqrt(s) (added
    # to norms). Same weights, without overflow at either end of the range.
    scale = _max_diag(gram)
    gram = gram / scale
    delta = ops.convert_to_tensor(1e-8, dtype) / scale
    delta_norm = ops.convert_to_tensor(1e-8, dtype) / ops.sqrt(scale)
    tiny = _tiny(dtype)
    g0_norm = ops.sqrt(ops.mean(gram) + delta)
    cc = c * g0_norm + delta_norm
    g_mean = ops.mean(gram, axis=1)  # G 1/T

    def gradient(w):
        gw = ops.matmul(gram, w)
        norm = ops.sqrt(ops.maximum(ops.sum(w * gw), 0.0) + delta)
        return g_mean + cc * gw / norm

    def line_search(w, d):
        gd = ops.matmul(gram, d)
        a, b = ops.sum(d * gd), ops.sum(w * gd)
        q0 = ops.maximum(ops.sum(w * ops.matmul(gram, w)), 0.0) + delta
        slope = ops.sum(d * g_mean)
        r = -slope / cc
        k = ops.maximum(a * q0 - b * b, 0.0)
        flat = a <= tiny
        a_safe = ops.where(flat, ops.ones_like(a), a)
        y = r * ops.sqrt(k / ops.maximum(a_safe - r * r, tiny))
        gamma = ops.where(r * r >= a_safe, ops.cast(r > 0, dtype), (y - b) / a_safe)
        return ops.where(flat, ops.cast(slope < 0, dtype), gamma)

    w = _pairwise_frank_wolfe(gram, gradient, line_search, max_iter)
    gw_norm = ops.sqrt(ops.maximum(ops.sum(w * ops.matmul(gram, w)), 0.0))
    lmbda = cc / (gw_norm + delta_norm)
    scale = {0: 1.0, 1: 1.0 + c**2, 2: 1.0 + c}[rescale]
    return (1.0 / num_tasks + lmbda * w) / scale
