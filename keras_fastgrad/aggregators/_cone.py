"""UPGrad, DualProj and ConFIG: directions that conflict with no task.

UPGrad and DualProj project onto the dual cone of the task gradients,
`{x : <g_j, x> >= 0 for all j}`; ConFIG picks the direction with equal
cosines to every task gradient. All three only see the Gram matrix
`G = J J^T` and return task weights `w` (merged gradient `w^T J`).

The projection of `J^T u` onto the dual cone is `J^T v` with `v` the
solution of the quadratic program `min_v v^T G v  s.t.  v >= u`
(Quinton & Rey 2024, Proposition 1). torchjd solves it with quadprog; here
it is solved exactly in-graph (`dual_cone_weights`, the active-set
method of `_qp.py`).
"""

import warnings

import tensorflow as tf

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._solvers import _eps, _tiny
from keras_fastgrad._qp import active_set_qp


def _check_number(name, value, minimum=0.0, maximum=None, open_min=False):
    """`value` as a float in `[minimum, maximum]` (`(minimum, ...` if open)."""
    low = f"> {minimum}" if open_min else f">= {minimum}"
    rule = low if maximum is None else f"{low} and <= {maximum}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > minimum if open_min else value >= minimum)
    ok = ok and (maximum is None or value <= maximum)
    if not ok:
        raise ValueError(f"`{name}` must be a number {rule}. Received: {name}={value!r}")
    return float(value)


def _finite_or_nan(gram, fn):
    """`fn` on `gram` if it is finite, else NaN weights (`fn` runs on `I`)."""
    num_tasks = gram.shape[0]
    finite = tf.reduce_all(tf.math.is_finite(gram))
    safe = tf.where(finite, gram, tf.eye(num_tasks, dtype=gram.dtype))
    return tf.where(finite, fn(safe), tf.constant(float("nan"), gram.dtype))


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
    top = tf.reduce_max(tf.linalg.diag_part(gram))
    top = tf.where(top > 0, top, tf.ones_like(top))
    scaled = gram / top
    trace = tf.linalg.trace(scaled)
    small = (trace * top < norm_eps) | (trace <= 0)
    gram = tf.where(small, tf.zeros_like(gram), scaled / tf.where(small, tf.ones_like(trace), trace))
    return gram + reg_eps * tf.eye(gram.shape[0], dtype=gram.dtype)


class _DualCone(aggregators.Aggregator):
    """Shared options of UPGrad and DualProj.

    Decision: `max_iter` (the cap on the coordinate-descent sweeps of
    versions up to 0.x, saved in their configs) is deprecated and ignored:
    the QP is now solved exactly (`dual_cone_weights`). It is still
    accepted, so `.keras` files saved with it load (silently, through
    `from_config`); passing it to the constructor warns.
    """

    def __init__(self, norm_eps=1e-4, reg_eps=1e-4, max_iter=None):
        self.norm_eps = _check_number("norm_eps", norm_eps)
        self.reg_eps = _check_number("reg_eps", reg_eps)
        if max_iter is not None:
            aggregators._check_int("max_iter", max_iter, 1)
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

    def _project(self, gram, targets):
        gram = normalized_regularized(gram, self.norm_eps, self.reg_eps)
        return dual_cone_weights(gram, targets)

    def get_config(self):
        return {"norm_eps": self.norm_eps, "reg_eps": self.reg_eps}


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

    >>> J = tf.constant([[1.0, 0.0], [-1.0, 1.0]], tf.float64)
    >>> gram = tf.matmul(J, J, transpose_b=True)
    >>> w = UPGrad(reg_eps=0.0).weights(gram)
    >>> w.numpy().round(4).tolist()
    [1.0, 0.75]
    >>> tf.linalg.matvec(gram, w).numpy().round(4).tolist()  # <g_i, w^T J> >= 0
    [0.25, 0.5]
    """

    name = "upgrad"

    def _weights(self, gram, seed_tensor):
        eye = tf.eye(gram.shape[0], dtype=gram.dtype) / gram.shape[0]
        return _finite_or_nan(gram, lambda g: tf.reduce_sum(self._project(g, eye), 0))


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

    >>> gram = tf.constant([[1.0, -2.0], [-2.0, 5.0]], tf.float64)  # mean conflicts
    >>> w = DualProj(reg_eps=0.0).weights(gram)
    >>> w.numpy().round(4).tolist()
    [1.0, 0.5]
    >>> tf.linalg.matvec(gram, w).numpy().round(4).tolist()  # <g_i, w^T J> >= 0
    [0.0, 0.5]
    >>> DualProj().weights(tf.eye(2)).numpy().round(4).tolist()  # no conflict: mean
    [0.5, 0.5]
    """

    name = "dualproj"

    def _weights(self, gram, seed_tensor):
        mean = tf.fill([1, gram.shape[0]], tf.constant(1.0 / gram.shape[0], gram.dtype))
        return _finite_or_nan(gram, lambda g: self._project(g, mean)[0])


@aggregators._register
class ConFIG(aggregators.Aggregator):
    """ConFIG (Liu et al., 2024), as the official `ConFIG_update` / torchjd.

    "ConFIG: Towards Conflict-free Training of Physics Informed Neural
    Networks", Equation 2: with the unit task gradients `U = D^-1 J`
    (`D = diag ||g_i||`; a zero gradient gives a zero row),
    `g_c = pinv(U) 1` has the same inner product with every unit gradient;
    the update is `(sum_i g_i . u) u` with `u = g_c / ||g_c||`. In Gram
    space `pinv(U) 1 = J^T x`, `x = D^-1 (D^-1 G D^-1)^+ 1`, so
    `w = x (1^T G x) / (x^T G x)` (0 when `g_c = 0`). The pseudo-inverse
    cuts eigenvalues of the normalised Gram below `T eps(dtype)` relative
    (torch's `pinv(U)` cuts singular values of `U` at `max(T, P) eps`
    relative; both keep every direction of well-conditioned gradients).
    The preference vector is all ones (the official default; any constant
    vector gives the same update). A non-finite `G` gives NaN weights.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> ConFIG().weights(gram).numpy().round(4).tolist()
    [0.75, 1.5]
    """

    name = "config"

    def _weights(self, gram, seed_tensor):
        return _finite_or_nan(gram, config_weights)


def config_weights(gram):
    """ConFIG task weights from the Gram matrix (see `ConFIG`)."""
    num_tasks, dtype = gram.shape[0], gram.dtype
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    positive = norms > tf.sqrt(_tiny(dtype))
    inv = tf.where(positive, 1.0 / tf.where(positive, norms, 1.0), 0.0)
    unit_gram = gram * inv[:, None] * inv[None, :]
    pinv = tf.linalg.pinv(unit_gram, rcond=num_tasks * _eps(dtype))
    ones = tf.ones([num_tasks], dtype)
    y = tf.linalg.matvec(pinv, ones)
    # One refinement step: XLA's SVD stops near 1e-7 relative, even in float64.
    y += tf.linalg.matvec(pinv, ones - tf.linalg.matvec(unit_gram, y))
    x = inv * y  # D^-1 (D^-1 G D^-1)^+ 1
    gx = tf.linalg.matvec(gram, x)
    norm_sq = tf.reduce_sum(x * gx)
    flat = norm_sq <= _tiny(dtype) * tf.reduce_max(tf.abs(gram))
    weights = x * tf.reduce_sum(gx) / tf.where(flat, tf.ones_like(norm_sq), norm_sq)
    return tf.where(flat, tf.zeros_like(weights), weights)
