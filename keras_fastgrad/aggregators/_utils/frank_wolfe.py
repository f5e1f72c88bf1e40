"""Pairwise Frank-Wolfe on the simplex (MGDA, CAGrad), in `keras.ops`."""

from keras import ops

from keras_fastgrad.aggregators._utils.numerics import _eps


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
    neg_inf = ops.convert_to_tensor(-float("inf"), dtype)

    def body(i, w, done):
        grad = gradient(w)
        s = ops.argmin(grad)
        v = ops.argmax(ops.where(w > 0, grad, neg_inf))
        gap = ops.sum(w * grad) - ops.take(grad, s)
        done = gap <= tol * ops.max(ops.abs(grad))
        d = ops.one_hot(s, num_tasks, dtype=dtype) - ops.one_hot(v, num_tasks, dtype=dtype)
        gamma = ops.clip(line_search(w, d), 0.0, ops.take(w, v))
        return i + 1, ops.maximum(w + gamma * d, 0.0), done

    w0 = ops.full([num_tasks], 1.0 / num_tasks, dtype=dtype)
    _, w, _ = ops.while_loop(
        lambda i, w, done: (i < max_iter) & ~done,
        body,
        (ops.convert_to_tensor(0, "int32"), w0, ops.convert_to_tensor(False)),
        maximum_iterations=max_iter,
    )
    return w / ops.sum(w)
