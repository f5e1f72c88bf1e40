"""Pairwise Frank-Wolfe on the simplex (MGDA, CAGrad)."""

import tensorflow as tf

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
