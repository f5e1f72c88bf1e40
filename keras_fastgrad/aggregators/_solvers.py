"""Coefficient-space solvers behind `keras_fastgrad.aggregators`.

Every function maps the Gram matrix `G = J J^T` of `T` task gradients
(`T` static) to task weights `w` of shape `[T]`, so that the merged gradient
is `w^T J`. Only TensorFlow ops are used: the functions trace in graph mode
and compile with `tf.function(jit_compile=True)`. Iterative solvers are
`tf.while_loop`s with a static iteration cap and an early stop on the
Frank-Wolfe duality gap.
"""

import tensorflow as tf

from keras_fastgrad._qp import _eps, _tiny, active_set_qp  # noqa: F401 (re-exported)


# Relative cut-off for "zero" eigenvalues in Aligned-MTL in every dtype:
# float32's eps, as the official code (`torch.finfo()`), so that a float64
# Gram of duplicated gradients drops its round-off eigenvalues too.
_RANK_EPS = 1.1920929e-07


def random_orders(num_tasks, uniform):
    """Visiting orders for PCGrad from `uniform`, a `[T, T]` draw in [0, 1).

    Row `i` is a uniformly random permutation of the tasks other than `i`:
    `i` gets the key 2, sorts last and is dropped. Returns int32 `[T, T-1]`.
    """
    own = tf.eye(num_tasks, dtype=tf.bool)
    keys = tf.where(own, tf.ones_like(uniform) * 2.0, uniform)
    return tf.argsort(keys, axis=1, stable=True)[:, : num_tasks - 1]


def pcgrad_weights(gram, orders):
    """PCGrad (Yu et al., 2020, Algorithm 1) in coefficient space.

    Task `i` starts at `c_i = e_i` (so `c_i^T J = g_i`) and visits
    `j = orders[i, 0], ..., orders[i, T-2]`; whenever
    `<g_i^PC, g_j> = (c_i^T G)_j < 0` it projects onto the normal plane of
    the original `g_j`: `c_i <- c_i - (c_i^T G)_j / G_jj * e_j`. Returns
    `sum_i c_i`. A task with `G_jj == 0` (zero gradient) is never projected
    on. All tasks are processed at once; the `T - 1` steps are unrolled.

    Args:
        gram: `[T, T]` float tensor.
        orders: int tensor `[T, T-1]`; row `i` lists the other tasks.

    Returns:
        `[T]` task weights.

    Example:

    The paper's tug of war, g1 = (-10, 0) and g2 = (1, -1):

    >>> w = pcgrad_weights(tf.constant([[100.0, -10.0], [-10.0, 2.0]]),
    ...                    tf.constant([[1], [0]]))
    >>> [round(v, 3) for v in w.numpy().tolist()]
    [1.1, 6.0]
    """
    gram = tf.convert_to_tensor(gram)
    num_tasks = gram.shape[0]
    orders = tf.convert_to_tensor(orders)
    diag = tf.linalg.diag_part(gram)
    coefs = tf.eye(num_tasks, dtype=gram.dtype)
    for k in range(num_tasks - 1):
        j = orders[:, k]
        dots = tf.reduce_sum(coefs * tf.gather(gram, j), axis=1)  # (c_i^T G)_j
        g_jj = tf.gather(diag, j)
        project = (dots < 0) & (g_jj > _tiny(gram.dtype))
        safe = tf.where(project, g_jj, tf.ones_like(g_jj))
        step = tf.where(project, dots / safe, 0.0)
        coefs = coefs - step[:, None] * tf.one_hot(j, num_tasks, dtype=gram.dtype)
    return tf.reduce_sum(coefs, axis=0)


def _pairwise_frank_wolfe(gram, gradient, line_search, max_iter):
    """Minimises a convex function over the simplex from the centre `1/T`.

    Each step moves mass from the worst active vertex `v` (largest gradient
    among `w_v > 0`) to the best vertex `s` (smallest gradient) with an exact
    line search `gamma in [0, w_v]` (pairwise Frank-Wolfe, Lacoste-Julien &
    Jaggi, 2015: linear convergence, where plain Frank-Wolfe is O(1/k)).
    Stops after `max_iter` steps or when the Frank-Wolfe gap
    `w^T grad - min(grad)` (an upper bound on the suboptimality) is at
    rounding level.
    """
    num_tasks, dtype = gram.shape[0], gram.dtype
    tol = 16.0 * _eps(dtype)
    neg_inf = tf.constant(-float("inf"), dtype)

    def body(i, w, done):
        grad = gradient(w)
        s = tf.argmin(grad, output_type=tf.int32)
        v = tf.argmax(tf.where(w > 0, grad, neg_inf), output_type=tf.int32)
        gap = tf.reduce_sum(w * grad) - tf.gather(grad, s)
        done = gap <= tol * tf.reduce_max(tf.abs(grad))
        d = tf.one_hot(s, num_tasks, dtype=dtype)
        d -= tf.one_hot(v, num_tasks, dtype=dtype)
        gamma = tf.clip_by_value(line_search(w, d), 0.0, tf.gather(w, v))
        return i + 1, tf.maximum(w + gamma * d, 0.0), done

    w0 = tf.fill([num_tasks], tf.constant(1.0 / num_tasks, dtype))
    _, w, _ = tf.while_loop(
        lambda i, w, done: (i < max_iter) & tf.logical_not(done),
        body,
        (tf.constant(0), w0, tf.constant(False)),
        maximum_iterations=max_iter,
    )
    return w / tf.reduce_sum(w)


def _max_diag(gram):
    """`max(diag G)`, or 1 when it is not positive (`G = 0`)."""
    top = tf.reduce_max(tf.linalg.diag_part(gram))
    return tf.where(top > 0, top, tf.ones_like(top))


@tf.function(autograph=False)  # a graph in eager mode too; inlined under XLA
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
    gram = tf.convert_to_tensor(gram)
    gram = gram / _max_diag(gram)

    def line_search(w, d):
        gd = tf.linalg.matvec(gram, d)
        a, b = tf.reduce_sum(d * gd), tf.reduce_sum(w * gd)
        flat = a <= _tiny(gram.dtype)
        a_safe = tf.where(flat, tf.ones_like(a), a)
        return tf.where(flat, tf.cast(b < 0, gram.dtype), -b / a_safe)

    w = _pairwise_frank_wolfe(
        gram, lambda w: tf.linalg.matvec(gram, w), line_search, max_iter
    )
    lower = tf.zeros([1, gram.shape[0]], gram.dtype)
    w = active_set_qp(gram, lower, simplex=True, start=w[None, :])[0][0]
    w = w / tf.reduce_sum(w)
    # A zero gradient is the min-norm point: its vertex, exactly.
    diag = tf.linalg.diag_part(gram)
    zero = tf.reduce_min(diag) <= tf.square(_eps(gram.dtype))
    vertex = tf.one_hot(tf.argmin(diag), gram.shape[0], dtype=gram.dtype)
    return tf.where(zero, vertex, w)


@tf.function(autograph=False)
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
    gram = tf.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    # In units of s = max(diag G): G_n = G / s, and the official constants
    # become delta / s (under the square roots) and delta / sqrt(s) (added
    # to norms). Same weights, without overflow at either end of the range.
    scale = _max_diag(gram)
    gram = gram / scale
    delta = tf.constant(1e-8, dtype) / scale
    delta_norm = tf.constant(1e-8, dtype) / tf.sqrt(scale)
    tiny = _tiny(dtype)
    g0_norm = tf.sqrt(tf.reduce_mean(gram) + delta)
    cc = c * g0_norm + delta_norm
    g_mean = tf.reduce_mean(gram, axis=1)  # G 1/T

    def gradient(w):
        gw = tf.linalg.matvec(gram, w)
        norm = tf.sqrt(tf.maximum(tf.reduce_sum(w * gw), 0.0) + delta)
        return g_mean + cc * gw / norm

    def line_search(w, d):
        gd = tf.linalg.matvec(gram, d)
        a, b = tf.reduce_sum(d * gd), tf.reduce_sum(w * gd)
        q0 = tf.maximum(tf.reduce_sum(w * tf.linalg.matvec(gram, w)), 0.0) + delta
        slope = tf.reduce_sum(d * g_mean)
        r = -slope / cc
        k = tf.maximum(a * q0 - b * b, 0.0)
        flat = a <= tiny
        a_safe = tf.where(flat, tf.ones_like(a), a)
        y = r * tf.sqrt(k / tf.maximum(a_safe - r * r, tiny))
        gamma = tf.where(r * r >= a_safe, tf.cast(r > 0, dtype), (y - b) / a_safe)
        return tf.where(flat, tf.cast(slope < 0, dtype), gamma)

    w = _pairwise_frank_wolfe(gram, gradient, line_search, max_iter)
    gw_norm = tf.sqrt(tf.maximum(tf.reduce_sum(w * tf.linalg.matvec(gram, w)), 0.0))
    lmbda = cc / (gw_norm + delta_norm)
    scale = {0: 1.0, 1: 1.0 + c**2, 2: 1.0 + c}[rescale]
    return (1.0 / num_tasks + lmbda * w) / scale


def imtl_weights(gram):
    """IMTL-G (Liu et al., 2021) from the Gram matrix, zero gradients allowed.

    The merged gradient `g = sum_t w_t g_t` (`sum_t w_t = 1`) has equal
    projections `<g, u_t> = c` on every unit gradient `u_t = g_t / ||g_t||`:
    `(G w)_t = c ||g_t||`, i.e. `w = G^+ d / sum(G^+ d)` with
    `d = sqrt(diag G)` the gradient norms. At full rank this is the paper's
    closed form (`alpha_{2:T} = g_1 U^T (D U^T)^{-1}`,
    `alpha_1 = 1 - sum(alpha_{2:T})`) rewritten in `G`; with the
    pseudo-inverse `(.)^+` it is torchjd's generalisation (`IMTLGWeighting`)
    to linearly dependent gradients. A task with a zero gradient has a zero
    row in `G` and `d_t = 0`: it gets weight 0 and the other tasks are
    balanced among themselves (the paper's form would put all the weight on
    it and return a zero update). Singular values up to `T eps(dtype)` times
    the largest are cut, as `numpy.linalg.pinv(rtol=None)`. When
    `sum(G^+ d)` is zero at rounding level (e.g. `G = 0`) the weights are 0,
    as torchjd. A non-finite `G` gives non-finite weights.

    Decision: `G` is divided by `max(diag G)` first. The weights do not
    depend on `G`'s scale, but XLA's SVD (behind `pinv`) has absolute
    tolerances: without this a Gram scaled by `1e-6` was 0.3 off under
    `jit_compile=True`, and float32 entries near `1e30` gave NaN.
    """
    gram = tf.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    gram = gram / _max_diag(gram)  # scale-free weights; XLA's SVD is not
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    pinv = tf.linalg.pinv(gram, rcond=num_tasks * _eps(dtype))
    v = tf.linalg.matvec(pinv, norms)
    # Refinement steps: XLA's SVD stops near 1e-7 relative, even in float64.
    for _ in range(2):
        v += tf.linalg.matvec(pinv, norms - tf.linalg.matvec(gram, v))
    total = tf.reduce_sum(v)
    degenerate = tf.abs(total) <= num_tasks * _eps(dtype) * tf.reduce_sum(tf.abs(v))
    safe_total = tf.where(degenerate, tf.ones_like(total), total)
    return tf.where(degenerate, tf.zeros_like(v), v / safe_total)


def aligned_balance_matrix(gram):
    """Aligned-MTL balance matrix `B = sqrt(l_min) V L^{-1/2} V^T`.

    `G = V L V^T` (`tf.linalg.eigh`); eigenvalues `<= max(L) T eps_float32` are
    dropped (the rank rule of the official `ProcrustesSolver`) and `l_min` is
    the smallest kept one. Then `B G B = l_min P` (`P` the projector on the
    kept eigenspace): the aligned task gradients `J^T B` are orthogonal with
    equal norms `sqrt(l_min)`. A zero `G` gives `B = 0`; a non-finite `G`
    gives `B = NaN` (without calling `eigh` on it).
    """
    gram = tf.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    # `eigh` raises on NaN/Inf on CPU (outside XLA): decompose a finite
    # stand-in and return NaN, so the step's finite check drops the batch.
    finite = tf.reduce_all(tf.math.is_finite(gram))
    lam, vec = tf.linalg.eigh(tf.where(finite, gram, tf.eye(num_tasks, dtype=dtype)))
    keep = lam > tf.reduce_max(lam) * num_tasks * _RANK_EPS
    lam_safe = tf.where(keep, lam, 1.0)
    lam_min = tf.reduce_min(tf.where(keep, lam, tf.constant(float("inf"), dtype)))
    any_kept = tf.reduce_any(keep)
    scale = tf.where(any_kept, tf.sqrt(tf.where(any_kept, lam_min, 1.0)), 0.0)
    inv_sqrt = tf.where(keep, tf.math.rsqrt(lam_safe), 0.0)
    balance = scale * tf.matmul(vec * inv_sqrt[None, :], vec, transpose_b=True)
    return tf.where(finite, balance, tf.constant(float("nan"), dtype))
