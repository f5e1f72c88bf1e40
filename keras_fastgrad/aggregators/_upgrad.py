"""UPGrad (Quinton & Rey, 2024): the mean of the task gradients, each
projected onto the dual cone of all of them."""

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.dual_cone import _DualCone


@aggregators._register
class UPGrad(_DualCone):
    """UPGrad (Quinton & Rey, 2024), torchjd's `UPGrad` with its defaults.

    "Jacobian Descent for Multi-Objective Optimization": each task
    gradient `g_i` is projected onto the dual cone of `{g_1, ..., g_T}`
    and the projections are averaged. The projection of `J^T u` is
    `J^T v(u)`, `v(u) = argmin v^T G v s.t. v >= u`; with torchjd's default
    preference vector (`1/T` each) the weights are
    `w = sum_i v(e_i / T) = mean_i v(e_i)`. As torchjd, `G` is first
    divided by its trace (`G = 0` when the trace is below `norm_eps`) and
    `reg_eps I` is added, so `v` solves a slightly regularised problem.
    The QP is solved exactly in-graph (`dual_cone_weights`, an active-set
    method). Without conflict (`G_ij >= 0`) and `reg_eps=0` this is the
    mean; the merged gradient never has a negative inner product with a
    task gradient (up to `reg_eps`). A non-finite `G` gives NaN weights.

    Args:
        norm_eps: float >= 0, the trace below which `G` counts as 0.
        reg_eps: float >= 0, the ridge added to the normalised `G`.
        max_iter: deprecated and ignored (the QP is solved exactly).

    Example:

    >>> J = np.array([[1.0, 0.0], [-1.0, 1.0]])
    >>> gram = J @ J.T
    >>> w = np.asarray(UPGrad(reg_eps=0.0).weights(gram))
    >>> w.round(4).tolist()
    [1.0, 0.75]
    >>> (gram @ w).round(4).tolist()  # <g_i, w^T J> >= 0
    [0.25, 0.5]
    """

    name = "upgrad"
    _targets = "each"
