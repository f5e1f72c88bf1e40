"""An exact active-set solver for the small quadratic programs of the
aggregators, in-graph.

`min_x x^T G x  s.t.  x >= lower` (and optionally `sum(x) = 1`), `G` a
`T x T` positive semi-definite Gram matrix, `T` static and small (the task
count). UPGrad and DualProj solve the first form (the dual-cone projection,
`lower` the vector to project), MGDA the second (the min-norm point of the
convex hull of the task gradients, `lower = 0`).

The method is Lawson & Hanson's active-set method for non-negative least
squares ("Solving Least Squares Problems", 1974, chapter 23), which these
problems are (`x^T G x = ||J^T x||^2`): coordinates are freed one at a time
(the one whose multiplier is most negative) and the problem restricted to
the free coordinates is solved exactly; a solution that leaves the feasible
set is cut back to it and the coordinates that hit their bound are fixed
again. Every iterate is feasible; the loop ends when the KKT conditions
hold to rounding level. Each step solves the full `T x T` (or
`T+1`, bordered) system with the fixed coordinates' rows and columns
replaced by the identity, so shapes stay static under XLA.
"""

import tensorflow as tf

from keras_fastgrad.aggregators._utils.numerics import _eps, _tiny


def max_steps(num_tasks):
    """The step cap: `10 T + 10` (a guard, never reached by a normal solve).

    Lawson-Hanson frees at most `T` coordinates and fixes each again at
    most as often as it was freed, so a solve typically takes `T` to `2 T`
    steps; the cap only ends a loop that rounding would make cycle.
    """
    return 10 * num_tasks + 10


def _restricted_solve(gram, lower, free, simplex, jitter):
    """Row-wise `argmin x^T G x` over the free coordinates (fixed ones at
    `lower`), and the multipliers of the bound constraints.

    Returns `(z, multipliers)`, both `[K, T]`: `multipliers = G z + mu` (`mu`
    the multiplier of `sum(x) = 1`, 0 without it), `>= 0` at an optimum on
    the fixed coordinates and `0` on the free ones.
    """
    num_tasks, dtype = gram.shape[0], gram.dtype
    f = tf.cast(free, dtype)  # [K, T]
    fixed = 1.0 - f
    system = f[:, :, None] * gram[None] * f[:, None, :] + tf.linalg.diag(fixed)
    ridge = tf.linalg.diag(jitter * f)  # [K, T, T]
    rhs = fixed * lower - f * tf.matmul(fixed * lower, gram)
    if simplex:
        # Bordered system: [G_PP 1; 1^T 0] [x_P; mu] = [-G_PA l_A; 1 - sum l_A].
        empty = 1.0 - tf.reduce_max(f, axis=1)  # no free coordinate: mu = 0
        top = tf.concat([system, f[:, :, None]], axis=2)
        bottom = tf.concat([f, empty[:, None]], axis=1)[:, None, :]
        system = tf.concat([top, bottom], axis=1)
        ridge = tf.pad(ridge, [[0, 0], [0, 1], [0, 1]])
        total = 1.0 - tf.reduce_sum(fixed * lower, axis=1, keepdims=True)
        rhs = tf.concat([rhs, total * (1.0 - empty[:, None])], axis=1)
    solution = tf.linalg.solve(system + ridge, rhs[:, :, None])[:, :, 0]
    # One refinement step against the system without the ridge.
    residual = rhs - tf.linalg.matvec(system, solution)
    solution += tf.linalg.solve(system + ridge, residual[:, :, None])[:, :, 0]
    z = solution[:, :num_tasks]
    mu = solution[:, num_tasks:] if simplex else 0.0
    return z, tf.matmul(z, gram) + mu


def active_set_qp(gram, lower, simplex=False, start=None):
    """Row `k`: `argmin_x x^T G x  s.t.  x >= lower[k]` (and `sum(x) = 1`).

    `G` is divided by its largest diagonal entry first (the solution does
    not depend on `G`'s scale; the tolerances are then relative). Each
    restricted solve adds a ridge of `T eps(dtype) max(G_ii, eps)` to the
    free diagonal entries, so that a singular block (duplicated or zero
    task gradients) never makes the solve fail, then takes one refinement
    step against the system without the ridge.

    Decision: a multiplier `(G x)_i + mu` counts as non-negative above
    `-16 T eps(dtype) sqrt(G_ii) sum_j sqrt(G_jj) |x_j|`, the rounding
    error of `(G x)_i` (it bounds `|(G x)_i|` by Cauchy-Schwarz), so that a
    task with a small gradient is judged on its own scale. At the cap (`max_steps`, which a normal
    solve never reaches) the last iterate is returned; it is feasible.

    Args:
        gram: `[T, T]` positive semi-definite float tensor, finite.
        lower: `[K, T]` float tensor, the bounds (one problem per row).
        simplex: bool; also require `sum(x) = 1` (needs `sum(lower) <= 1`).
        start: optional feasible `[K, T]` starting point; its coordinates
            above `lower` start free. Defaults to `lower` (all fixed), or
            with `simplex` to the vertex of the smallest `G_ii`.

    Returns:
        `(x, steps)`: the `[K, T]` solutions and the int32 number of steps.

    Example:

    >>> gram = tf.constant([[1.0, -2.0], [-2.0, 5.0]], tf.float64)
    >>> x, steps = active_set_qp(gram, tf.constant([[0.5, 0.5]], tf.float64))
    >>> x.numpy().round(4).tolist(), int(steps)
    ([[1.0, 0.5]], 2)
    >>> x, _ = active_set_qp(tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64),
    ...                      tf.zeros([1, 2], tf.float64), simplex=True)
    >>> x.numpy().round(4).tolist()  # MGDA's min-norm weights
    [[0.2, 0.8]]
    """
    gram = tf.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    lower = tf.cast(lower, dtype)
    rows = lower.shape[0]
    diag = tf.linalg.diag_part(gram)
    scale = tf.reduce_max(diag)
    gram = gram / tf.where(scale > 0, scale, tf.ones_like(scale))
    eps, tiny = _eps(dtype), _tiny(dtype)
    diag = tf.linalg.diag_part(gram)
    jitter = num_tasks * eps * tf.maximum(diag, eps)  # [T]
    norms = tf.sqrt(tf.maximum(diag, 0.0))
    tol = 16.0 * num_tasks * eps
    if start is None and simplex:
        start = lower + tf.one_hot(tf.argmin(diag), num_tasks, dtype=dtype)[None, :]
    x = lower if start is None else tf.maximum(tf.cast(start, dtype), lower)
    free = x > lower
    inf = tf.constant(float("inf"), dtype)

    def body(step, x, free, fresh, done):
        z, multipliers = _restricted_solve(gram, lower, free, simplex, jitter)
        z = tf.where(free, z, lower)
        blocked = free & (z <= lower)
        feasible = ~tf.reduce_any(blocked, axis=1)
        # Feasible: take z; free the fixed coordinate of most negative
        # multiplier, or stop when none is below -tol.
        size = tf.reduce_sum(tf.abs(z) * norms, axis=1, keepdims=True)
        candidate = tf.where(free, inf, multipliers / tf.maximum(norms * size, tiny))
        worst = tf.argmin(candidate, axis=1, output_type=tf.int32)
        optimal = tf.reduce_min(candidate, axis=1) >= -tol
        add = tf.one_hot(worst, num_tasks, on_value=True, off_value=False)
        add &= ~optimal[:, None]
        # Infeasible: move from x towards z until a bound is hit; fix the
        # coordinates at their bound. If the coordinate freed by the
        # previous step (free, still at its bound) is blocked at once, its
        # multiplier was negative only by rounding: stop there.
        ratio = tf.where(blocked, (x - lower) / tf.where(blocked, x - z, 1.0), inf)
        alpha = tf.clip_by_value(tf.reduce_min(ratio, axis=1, keepdims=True), 0.0, 1.0)
        moved = x + alpha * (z - x)
        hit = free & ((blocked & (ratio <= alpha)) | (moved <= lower))
        moved = tf.where(hit, lower, moved)
        just_freed = free & (x <= lower)
        stalled = ~feasible & fresh & tf.reduce_any(blocked & just_freed, axis=1)

        keep = (done | stalled)[:, None]
        new_x = tf.where(feasible[:, None], z, moved)
        new_free = tf.where(feasible[:, None], free | add, free & ~hit)
        done |= (feasible & optimal) | stalled
        return (
            step + 1,
            tf.where(keep, x, new_x),
            tf.where(keep, free, new_free),
            feasible & ~optimal,
            done,
        )

    steps, x, _, _, _ = tf.while_loop(
        lambda step, x, free, fresh, done: (step < max_steps(num_tasks)) & ~tf.reduce_all(done),
        body,
        (tf.constant(0), x, free, tf.zeros([rows], tf.bool), tf.zeros([rows], tf.bool)),
        maximum_iterations=max_steps(num_tasks),
    )
    return x, steps
