"""DualProj (Quinton & Rey, 2024): the mean of the task gradients,
projected onto their dual cone."""

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.dual_cone import _DualCone


@aggregators._register
class DualProj(_DualCone):
    """DualProj (Quinton & Rey, 2024), torchjd's `DualProj` with its defaults.

    The mean gradient projected onto the dual cone of the task gradients
    (the projection of Lopez-Paz & Ranzato's GEM, Equation 11):
    `w = v(1/T) = argmin v^T G v  s.t.  v >= 1/T`. `G` is normalised and
    regularised as in `UPGrad`; the QP is solved in-graph
    (`dual_cone_weights`). A non-finite `G` gives NaN weights.

    Args:
        norm_eps: float >= 0, the trace below which `G` counts as 0.
        reg_eps: float >= 0, the ridge added to the normalised `G`.
        max_iter: deprecated and ignored (the QP is solved exactly).

    Example:

    >>> gram = np.array([[1.0, -2.0], [-2.0, 5.0]])  # the mean conflicts
    >>> w = np.asarray(DualProj(reg_eps=0.0).weights(gram))
    >>> w.round(4).tolist()
    [1.0, 0.5]
    >>> (gram @ w).round(4).tolist()  # <g_i, w^T J> >= 0
    [0.0, 0.5]
    >>> np.asarray(DualProj().weights(np.eye(2))).round(4).tolist()  # the mean
    [0.5, 0.5]
    """

    name = "dualproj"
    _targets = "mean"
