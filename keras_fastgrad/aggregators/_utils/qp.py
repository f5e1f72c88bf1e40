"""An exact active-set solver for the small quadratic programs of the
aggregators, in-graph (`keras.ops`: TensorFlow and JAX).

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

from keras import ops

from keras_fastgrad.aggregators._utils.numerics import _compiled, _eps, _tiny


def max_steps(num_tasks):
    """The step cap: `10 T + 10` (a guard, never reached by a normal solve).

    Lawson-Hanson frees at most `T` coordinates and fixes each again at
    most as often as it was freed, so a solve typically takes `T` to `2 T`
    steps; the cap only ends a loop that rounding would make cycle.
    """
    return 10 * num_tasks + 10


def _batched_diag(x, eye):
    """`[K, T]` -> `[K, T, T]` diagonal matrices (`eye` the `T x T` identity)."""
    return x[:, :, None] * eye[None]


def _matvec(a, x):
    """`[K, N, N] x [K, N] -> [K, N]`."""
    return ops.matmul(a, x[:, :, None])[:, :, 0]


def _restricted_solve(gram, lower, free, simplex, jitter):
    """Row-wise `argmin x^T G x` over the free coordinates (fixed ones at
    `lower`), and the multipliers of the bound constraints.

    Returns `(z, multipliers)`, both `[K, T]`: `multipliers = G z + mu` (`mu`
    the multiplier of `sum(x) = 1`, 0 without it), `>= 0` at an optimum on
    the fixed coordinates and `0` on the free ones.
    """
    num_tasks, dtype = gram.shape[0], gram.dtype
    eye = ops.eye(num_tasks, dtype=dtype)
    f = ops.cast(free, dtype)  # [K, T]
    fixed = 1.0 - f
    system = f[:, :, None] * gram[None] * f[:, None, :] + _batched_diag(fixed, eye)
    ridge = _batched_diag(jitter * f, eye)  # [K, T, T]
    rhs = fixed * lower - f * ops.matmul(fixed * lower, gram)
    if simplex:
        # Bordered system: [G_PP 1; 1^T 0] [x_P; mu] = [-G_PA l_A; 1 - sum l_A].
        empty = 1.0 - ops.max(f, axis=1)  # no free coordinate: mu = 0
        top = ops.concatenate([system, f[:, :, None]], axis=2)
        bottom = ops.concatenate([f, empty[:, None]], axis=1)[:, None, :]
        system = ops.concatenate([top, bottom], axis=1)
        ridge = ops.pad(ridge, [[0, 0], [0, 1], [0, 1]])
        total = 1.0 - ops.sum(fixed * lower, axis=1, keepdims=True)
        rhs = ops.concatenate([rhs, total * (1.0 - empty[:, None])], axis=1)
    solution = ops.solve(system + ridge, rhs[:, :, None])[:, :, 0]
    # One refinement step against the system without the ridge.
    residual = rhs - _matvec(system, solution)
    solution += ops.solve(system + ridge, residual[:, :, None])[:, :, 0]
    z = solution[:, :num_tasks]
    mu = solution[:, num_tasks:] if simplex else 0.0
    return z, ops.matmul(z, gram) + mu


@_compiled(static_argnames=("simplex",))
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

    >>> gram = ops.convert_to_tensor([[1.0, -2.0], [-2.0, 5.0]])
    >>> x, steps = active_set_qp(gram, ops.convert_to_tensor([[0.5, 0.5]]))
    >>> ops.convert_to_numpy(x).round(4).tolist(), int(steps)
    ([[1.0, 0.5]], 2)
    >>> x, _ = active_set_qp(ops.convert_to_tensor([[4.0, 0.0], [0.0, 1.0]]),
    ...                      ops.zeros([1, 2]), simplex=True)
    >>> ops.convert_to_numpy(x).round(4).tolist()  # MGDA's min-norm weights
    [[0.2, 0.8]]
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    lower = ops.cast(lower, dtype)
    rows = lower.shape[0]
    diag = ops.diagonal(gram)
    scale = ops.max(diag)
    gram = gram / ops.where(scale > 0, scale, ops.ones_like(scale))
    eps, tiny = _eps(dtype), _tiny(dtype)
    diag = ops.diagonal(gram)
    jitter = num_tasks * eps * ops.maximum(diag, eps)  # [T]
    norms = ops.sqrt(ops.maximum(diag, 0.0))
    tol = 16.0 * num_tasks * eps
    if start is None and simplex:
        start = lower + ops.one_hot(ops.argmin(diag), num_tasks, dtype=dtype)[None, :]
    x = lower if start is None else ops.maximum(ops.cast(start, dtype), lower)
    free = x > lower
    inf = ops.convert_to_tensor(float("inf"), dtype)
    tasks = ops.arange(num_tasks, dtype="int32")

    def body(step, x, free, fresh, done):
        z, multipliers = _restricted_solve(gram, lower, free, simplex, jitter)
        z = ops.where(free, z, lower)
        blocked = free & (z <= lower)
        feasible = ~ops.any(blocked, axis=1)
        # Feasible: take z; free the fixed coordinate of most negative
        # multiplier, or stop when none is below -tol.
        size = ops.sum(ops.abs(z) * norms, axis=1, keepdims=True)
        candidate = ops.where(free, inf, multipliers / ops.maximum(norms * size, tiny))
        worst = ops.cast(ops.argmin(candidate, axis=1), "int32")
        optimal = ops.min(candidate, axis=1) >= -tol
        add = (tasks[None, :] == worst[:, None]) & ~optimal[:, None]
        # Infeasible: move from x towards z until a bound is hit; fix the
        # coordinates at their bound. If the coordinate freed by the
        # previous step (free, still at its bound) is blocked at once, its
        # multiplier was negative only by rounding: stop there.
        ratio = ops.where(blocked, (x - lower) / ops.where(blocked, x - z, 1.0), inf)
        alpha = ops.clip(ops.min(ratio, axis=1, keepdims=True), 0.0, 1.0)
        moved = x + alpha * (z - x)
        hit = free & ((blocked & (ratio <= alpha)) | (moved <= lower))
        moved = ops.where(hit, lower, moved)
        just_freed = free & (x <= lower)
        stalled = ~feasible & fresh & ops.any(blocked & just_freed, axis=1)

        keep = (done | stalled)[:, None]
        new_x = ops.where(feasible[:, None], z, moved)
        new_free = ops.where(feasible[:, None], free | add, free & ~hit)
        done = done | (feasible & optimal) | stalled
        return (
            step + 1,
            ops.where(keep, x, new_x),
            ops.where(keep, free, new_free),
            feasible & ~optimal,
            done,
        )

    cap = max_steps(num_tasks)
    steps, x, _, _, _ = ops.while_loop(
        lambda step, x, free, fresh, done: (step < cap) & ~ops.all(done),
        body,
        (
            ops.convert_to_tensor(0, "int32"),
            x,
            free,
            ops.zeros([rows], "bool"),
            ops.zeros([rows], "bool"),
        ),
        maximum_iterations=cap,
    )
    return x, steps
