"""UPGrad, DualProj and ConFIG: directions that conflict with no task.

UPGrad and DualProj project onto the dual cone of the task gradients,
`{x : <g_j, x> >= 0 for all j}`; ConFIG picks the direction with equal
cosines to every task gradient. All three only see the Gram matrix
`G = J J^T` and return task weights `w` (merged gradient `w^T J`).

The projection of `J^T u` onto the dual cone is `J^T v` with `v` the
solution of the quadratic program `min_v v^T G v  s.t.  v >= u`
(Quinton & Rey 2024, Proposition 1). torchjd solves it with quadprog; here
it is solved in-graph (`dual_cone_weights`): coordinate-descent sweeps,
each followed by an exact solve on the sweep's active set that is kept
once it satisfies the KKT conditions.
"""

import tensorflow as tf

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._solvers import _eps, _tiny


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


def dual_cone_weights(gram, targets, max_iter=200):
    """Row `k`: `v = argmin v^T G v  s.t.  v >= targets[k]`.

    `J^T v` is then the projection of `J^T targets[k]` onto the dual cone
    of the rows of `J`. With `v = u + s`, `s >= 0`, a coordinate-descent
    sweep sets in turn `v_i <- max(u_i, v_i - (G v)_i / G_ii)` (all rows
    at once). After each sweep the active set (`v_i = u_i`) is solved
    exactly: `(G v)_i = 0` on the free coordinates, `v_i = u_i` on the
    others. That solution is taken, and the loop stops, once it is
    feasible (`v >= u`) and dual feasible (`(G v)_i >= 0` where active),
    up to `64 T eps(dtype)` relative; else at most `max_iter` sweeps.
    A coordinate with `G_ii = 0` (a zero gradient) stays at `u_i`.

    Args:
        gram: `[T, T]` positive semi-definite float tensor.
        targets: `[K, T]` float tensor, one `u` per row.
        max_iter: int, the cap on the sweeps.

    Returns:
        `[K, T]` tensor `V`.
    """
    num_tasks, dtype = gram.shape[0], gram.dtype
    diag = tf.linalg.diag_part(gram)
    scale = tf.reduce_max(tf.abs(diag))
    has_curvature = diag > _tiny(dtype)
    inv_diag = tf.where(has_curvature, 1.0 / tf.where(has_curvature, diag, 1.0), 0.0)
    tol = 64.0 * num_tasks * _eps(dtype)
    eye = tf.eye(num_tasks, dtype=dtype)
    jitter = _eps(dtype) * scale * eye  # keeps exactly singular systems solvable

    def sweep(v):
        for i in range(num_tasks):
            col = tf.linalg.matvec(v, gram[:, i])  # (G v)_i for every row
            new = tf.maximum(targets[:, i], v[:, i] - col * inv_diag[i])
            new = tf.where(has_curvature[i], new, targets[:, i])
            v += (new - v[:, i])[:, None] * eye[i][None, :]
        return v

    def polish(v):
        free = tf.cast(v > targets, dtype)  # [K, T]
        fixed = 1.0 - free
        system = free[:, :, None] * gram[None] * free[:, None, :]
        system += tf.linalg.diag(fixed) + jitter[None]
        rhs = fixed * targets - free * tf.matmul(fixed * targets, gram)
        exact = tf.linalg.solve(system, rhs[:, :, None])[:, :, 0]
        grad = tf.matmul(exact, gram)
        size = tf.reduce_max(tf.abs(exact), axis=1, keepdims=True)
        ok = exact >= targets - tol * size  # primal feasible
        ok &= (free > 0) | (grad >= -tol * size * scale)  # multipliers >= 0
        ok &= (fixed > 0) | (tf.abs(grad) <= tol * size * scale)  # stationary
        return tf.maximum(exact, targets), tf.reduce_all(ok, axis=1)

    def body(i, v, done):
        v = sweep(v)
        exact, ok = polish(v)
        v = tf.where(ok[:, None], exact, v)
        return i + 1, v, tf.reduce_all(ok)

    _, v, _ = tf.while_loop(
        lambda i, v, done: (i < max_iter) & tf.logical_not(done),
        body,
        (tf.constant(0), tf.identity(targets), tf.constant(False)),
        maximum_iterations=max_iter,
    )
    return v


def normalized_regularized(gram, norm_eps, reg_eps):
    """torchjd's `regularize(normalize(G, norm_eps), reg_eps)`: `G / trace G`
    (zeros when `trace G < norm_eps`), plus `reg_eps I`."""
    trace = tf.linalg.trace(gram)
    small = trace < norm_eps
    gram = tf.where(small, tf.zeros_like(gram), gram / tf.where(small, tf.ones_like(trace), trace))
    return gram + reg_eps * tf.eye(gram.shape[0], dtype=gram.dtype)


class _DualCone(aggregators.Aggregator):
    """Shared options of UPGrad and DualProj."""

    def __init__(self, norm_eps=1e-4, reg_eps=1e-4, max_iter=200):
        self.norm_eps = _check_number("norm_eps", norm_eps)
        self.reg_eps = _check_number("reg_eps", reg_eps)
        self.max_iter = aggregators._check_int("max_iter", max_iter, 1)

    def _project(self, gram, targets):
        gram = normalized_regularized(gram, self.norm_eps, self.reg_eps)
        return dual_cone_weights(gram, targets, self.max_iter)

    def get_config(self):
        return {"norm_eps": self.norm_eps, "reg_eps": self.reg_eps, "max_iter": self.max_iter}


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
    The QP is solved in-graph (`dual_cone_weights`, at most `max_iter`
    sweeps). Without conflict (`G_ij >= 0`) and `reg_eps=0` this is the
    mean; the merged gradient never has a negative inner product with a
    task gradient (up to `reg_eps`). A non-finite `G` gives NaN weights.

    Args:
        norm_eps: float >= 0, the trace below which `G` counts as 0.
        reg_eps: float >= 0, the ridge added to the normalised `G`.
        max_iter: int >= 1, the cap on the solver's sweeps.

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
        max_iter: int >= 1, the cap on the solver's sweeps.

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
