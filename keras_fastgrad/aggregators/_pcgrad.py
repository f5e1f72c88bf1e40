"""PCGrad (Yu et al., NeurIPS 2020): project each task's gradient off
the tasks it conflicts with, in a random order."""

import keras
import numpy as np
from keras import ops

from keras_fastgrad.aggregators._base import Aggregator, _check_gram, _register
from keras_fastgrad.aggregators._utils.numerics import _compiled, _tiny


@_register
class PCGrad(Aggregator):
    """PCGrad, "Gradient Surgery for Multi-Task Learning" (Yu et al., NeurIPS 2020).

    Algorithm 1: for each task `i`, `g_i^PC = g_i`; for each other task `j`
    in a fresh random order, if `<g_i^PC, g_j> < 0` then
    `g_i^PC <- g_i^PC - <g_i^PC, g_j> / ||g_j||^2 g_j`. The merged gradient
    is `sum_i g_i^PC`. Computed on coefficients (`g_i^PC = c_i^T J`, see
    `pcgrad_weights`); `w = sum_i c_i`. Each call draws new orders from the
    aggregator's `keras.random.SeedGenerator` (`seed_generator`, whose
    state is a variable: new orders per call inside a compiled TensorFlow
    step too; build the aggregator outside any `tf.function`). Under
    `jax.jit`, map `seed_generator.state` in a `keras.StatelessScope` and
    return its new value, as the JAX step does (else the traced state
    leaks into the variable). `orders` (int `[T, T-1]`, row `i` the
    visiting order of task `i`) fixes them.

    Args:
        seed: int or None, the seed of the generator.

    Example:

    >>> J = np.array([[-10.0, 0.0], [1.0, -1.0]])  # tug of war
    >>> w = PCGrad(seed=0).weights(J @ J.T)
    >>> keras.ops.convert_to_numpy(w).round(4).tolist()
    [1.1, 6.0]
    >>> gram3 = np.eye(3) - 0.2  # three conflicting tasks
    >>> orders = [[1, 2], [0, 2], [0, 1]]  # task 0 visits 1 then 2, ...
    >>> w = PCGrad().weights(gram3, orders=orders)
    >>> keras.ops.convert_to_numpy(w).round(4).tolist()
    [1.5, 1.5625, 1.625]
    """

    name = "pcgrad"

    def __init__(self, seed=None):
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def weights(self, gram, orders=None):
        """As `Aggregator.weights`; `orders` (int `[T, T-1]`) fixes the order."""
        if orders is None:
            return super().weights(gram)
        orders = ops.convert_to_tensor(orders, "int32")
        num_tasks = _check_gram(gram).shape[0]
        if tuple(orders.shape) != (num_tasks, num_tasks - 1):
            raise ValueError(
                f"`orders` must have shape ({num_tasks}, {num_tasks - 1}) for "
                f"{num_tasks} tasks. Received: orders.shape={tuple(orders.shape)}"
            )
        return self._run(gram, lambda g: pcgrad_weights(g, orders))

    def _weights(self, gram):
        shape = [gram.shape[0]] * 2
        uniform = keras.random.uniform(shape, seed=self.seed_generator)
        return pcgrad_weights(gram, random_orders(shape[0], uniform))

    def get_config(self):
        return {"seed": self.seed}


def random_orders(num_tasks, uniform):
    """Visiting orders for PCGrad from `uniform`, a `[T, T]` draw in [0, 1).

    Row `i` is a uniformly random permutation of the tasks other than `i`:
    `i`'s key is raised by 2, sorts last and is dropped (`ops.argsort` is
    stable on TensorFlow and JAX). Returns int `[T, T-1]`.
    """
    keys = uniform + 2.0 * np.eye(num_tasks, dtype=keras.backend.standardize_dtype(uniform.dtype))
    return ops.argsort(keys, axis=1)[:, : num_tasks - 1]


@_compiled()
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

    >>> w = pcgrad_weights(np.array([[100.0, -10.0], [-10.0, 2.0]]), [[1], [0]])
    >>> keras.ops.convert_to_numpy(w).round(3).tolist()
    [1.1, 6.0]
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], gram.dtype
    # picks[:, k]: row i is e_j for j = orders[i, k] (rows of G by matmul:
    # exact, the other terms are zeros).
    picks = ops.one_hot(orders, num_tasks, dtype=dtype)
    diag = ops.diagonal(gram)
    coefs = ops.eye(num_tasks, dtype=dtype)
    for k in range(num_tasks - 1):
        pick = picks[:, k]
        dots = ops.sum(coefs * ops.matmul(pick, gram), axis=1)  # (c_i^T G)_j
        g_jj = ops.sum(pick * diag, axis=1)
        project = (dots < 0) & (g_jj > _tiny(dtype))
        step = ops.where(project, dots / ops.where(project, g_jj, 1.0), 0.0)
        coefs = coefs - ops.expand_dims(step, 1) * pick
    return ops.sum(coefs, axis=0)
