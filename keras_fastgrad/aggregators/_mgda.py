"""MGDA-UB (Sener & Koltun, NeurIPS 2018): the min-norm point of the
convex hull of the task gradients."""

from keras import ops

from keras_fastgrad._validation import check_int
from keras_fastgrad.aggregators._base import Aggregator, _register
from keras_fastgrad.aggregators._utils.frank_wolfe import _pairwise_frank_wolfe
from keras_fastgrad.aggregators._utils.numerics import _compiled, _eps, _max_diag, _tiny
from keras_fastgrad.aggregators._utils.qp import active_set_qp


@_register
class MGDA(Aggregator):
    """MGDA-UB (Sener & Koltun, NeurIPS 2018).

    "Multi-Task Learning as Multi-Objective Optimization":
    `w = argmin_{w in simplex} w^T G w`, the min-norm point of the convex
    hull of the task gradients. Solved by Frank-Wolfe in Gram space from
    `w = 1/T` with exact line search (Algorithm 2), using pairwise steps
    (move mass from the worst active task to the best one), which converge
    linearly where plain Frank-Wolfe steps are O(1/k); the loop stops once
    the duality gap is at rounding level, or after `max_iter` steps. An
    exact active-set solve of the simplex QP, started from that point,
    then lands on the KKT point (`min_norm_weights`), also when
    the task gradients' norms are orders of magnitude apart.

    Args:
        max_iter: int, the cap on the solver steps.

    Example:

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> ops.convert_to_numpy(MGDA().weights(gram)).round(4).tolist()
    [0.2, 0.8]
    """

    name = "mgda"

    def __init__(self, max_iter=1000):
        self.max_iter = check_int("max_iter", max_iter, 1)

    def _weights(self, gram):
        return min_norm_weights(gram, self.max_iter)

    def get_config(self):
        return {"max_iter": self.max_iter}


@_compiled(static_argnames=("max_iter",))
def min_norm_weights(gram, max_iter=1000):
    """MGDA-UB: `argmin_{w in simplex} w^T G w` (Sener & Koltun, 2018).

    Pairwise Frank-Wolfe with an exact line search along `d`:
    `gamma = -(d^T G w) / (d^T G d)`, the closed form of the paper's
    Algorithm 2 / `_min_norm_element_from2`; then an exact active-set solve
    of the simplex QP started from the Frank-Wolfe point
    (`_qp.active_set_qp`), which lands on the KKT point even when the task
    gradients' norms differ by many orders of magnitude (where the
    Frank-Wolfe gap test stops early). `G` is first divided by
    `max(diag G)`: the weights do not depend on `G`'s scale.

    Decision: a task whose `G_ii` is at most `eps(dtype)^2 max(diag G)`
    (a zero gradient, at rounding level) gets all the weight: its vertex is
    the min-norm point (norm 0), where the simplex QP is singular.
    """
    gram = ops.convert_to_tensor(gram)
    gram = gram / _max_diag(gram)

    def line_search(w, d):
        gd = ops.matmul(gram, d)
        a, b = ops.sum(d * gd), ops.sum(w * gd)
        flat = a <= _tiny(gram.dtype)
        a_safe = ops.where(flat, ops.ones_like(a), a)
        return ops.where(flat, ops.cast(b < 0, gram.dtype), -b / a_safe)

    w = _pairwise_frank_wolfe(gram, lambda w: ops.matmul(gram, w), line_search, max_iter)
    lower = ops.zeros([1, gram.shape[0]], gram.dtype)
    w = active_set_qp(gram, lower, simplex=True, start=w[None, :])[0][0]
    w = w / ops.sum(w)
    # A zero gradient is the min-norm point: its vertex, exactly.
    diag = ops.diagonal(gram)
    zero = ops.min(diag) <= ops.square(_eps(gram.dtype))
    vertex = ops.one_hot(ops.argmin(diag), gram.shape[0], dtype=gram.dtype)
    return ops.where(zero, vertex, w)
