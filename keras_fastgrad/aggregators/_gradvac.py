"""GradVac: PCGrad-like surgery towards moving targets of task similarity.

Gradient Vaccine (Wang et al., ICLR 2021) keeps, for every ordered pair of
tasks, an exponential moving average `phi_hat_ij` of their cosine
similarity and alters `g_i` whenever its cosine with `g_j` falls below the
target. The targets are state: a `[T, T]` float32 variable created when
the task count is known (`build`), moved by `TaskMerger` only when the
merged gradient is finite, and saved in `.keras` / `.weights.h5` files as
an entry of its own (`multitask`), which a plain `keras.Model` ignores.
"""

import keras
import numpy as np
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad._validation import check_number
from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.numerics import _compiled, _dtype, _eps, _tiny


@_compiled(static_argnames=("beta",))
def gradvac_weights(gram, targets, beta):
    """GradVac in coefficient space: `(weights, new_targets)`.

    Task `i` starts at `c_i = e_i` (`g_i' = c_i^T J`) and visits the other
    tasks `j` in increasing order (the paper and LibMTL shuffle them; a
    fixed order makes the step deterministic). With
    `phi = cos(g_i', g_j) = (c_i^T G)_j / (||g_i'|| sqrt(G_jj))` and the
    target `t = targets[i, j]`: if `phi < t`,
    `c_i <- c_i + ||g_i'|| (t sqrt(1 - phi^2) - phi sqrt(1 - t^2)) /
    (sqrt(G_jj) sqrt(1 - t^2)) e_j`; then (always)
    `targets[i, j] <- (1 - beta) t + beta phi`. A pair with a zero gradient
    has no cosine: it is neither altered nor does its target move. A
    non-finite `G` gives NaN weights and leaves the targets unchanged.
    `1 - t^2` is kept above `eps(dtype)`. Returns `sum_i c_i` and the new
    targets. With all targets 0 the first step is PCGrad's.

    Args:
        gram: `[T, T]` float tensor.
        targets: `[T, T]` tensor of the EMA targets (diagonal unused).
        beta: float in `[0, 1]`, the EMA rate.

    Returns:
        `([T] weights, [T, T] new targets)` in the dtype of `gram`.

    Example:

    >>> J = np.array([[1.0, 0.0], [-1.0, 1.0]])
    >>> w, targets = gradvac_weights(J @ J.T, np.zeros((2, 2)), beta=0.5)
    >>> keras.ops.convert_to_numpy(w).round(4).tolist()  # targets 0: PCGrad
    [2.0, 1.5]
    >>> keras.ops.convert_to_numpy(targets).round(4).tolist()  # beta * cos
    [[0.0, -0.3536], [-0.3536, 0.0]]
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], _dtype(gram.dtype)
    old = ops.cast(targets, dtype)
    finite = ops.all(ops.isfinite(gram))
    gram = ops.where(finite, gram, 0.0)  # NaN out, targets kept
    targets = old
    norms = ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0))
    coefs = ops.eye(num_tasks, dtype=dtype)
    for k in range(num_tasks - 1):
        # Row i of `pick`: e_j, j the k-th other task of i (static).
        pick = np.eye(num_tasks, dtype=dtype)[[k + (k >= i) for i in range(num_tasks)]]
        dots = ops.sum(coefs * ops.matmul(pick, gram), axis=1)  # <g_i', g_j>
        norm_i = ops.sqrt(ops.maximum(ops.sum(coefs * ops.matmul(coefs, gram), axis=1), 0.0))
        norm_j = ops.matmul(pick, norms)
        valid = norm_i * norm_j > _tiny(dtype)
        phi = ops.where(valid, dots / ops.where(valid, norm_i * norm_j, 1.0), 0.0)
        phi = ops.clip(phi, -1.0, 1.0)
        target = ops.sum(targets * pick, axis=1)
        root_t = ops.sqrt(ops.maximum(1.0 - target * target, _eps(dtype)))
        root_phi = ops.sqrt(ops.maximum(1.0 - phi * phi, 0.0))
        step = norm_i * (target * root_phi - phi * root_t)
        step = step / (ops.where(valid, norm_j, 1.0) * root_t)
        step = ops.where(valid & (phi < target), step, 0.0)
        coefs = coefs + step[:, None] * pick
        moved = ops.where(valid, (1.0 - beta) * target + beta * phi, target)
        targets = targets + (moved - target)[:, None] * pick
    weights = ops.where(finite, ops.sum(coefs, axis=0), float("nan"))
    return weights, ops.where(finite, targets, old)


@aggregators._register
class GradVac(aggregators.Aggregator, compat.KerasSaveable):
    """GradVac (Wang et al., ICLR 2021), "Gradient Vaccine".

    "Gradient Vaccine: Investigating and Improving Multi-task Optimization
    in Massively Multilingual Models", Algorithm 1, in coefficient space
    (`gradvac_weights`): each `g_i` is moved towards every other `g_j`
    whose cosine with it is below the EMA target `phi_hat_ij`, and the
    altered gradients are summed. The targets (`[T, T]`, starting at 0, so
    the first step is PCGrad's) are a variable created by `build`; the
    `FastGradModel` step moves them after each micro-batch whose merged
    gradient is finite, and saves them with the model. `weights` alone
    reads the targets (zeros before `build`) without moving them;
    `weights_and_state` also returns the moved targets. Tasks visit the
    others in a fixed increasing order (the paper shuffles).

    Args:
        beta: float in `[0, 1]`, the EMA rate of the targets; defaults to
            `0.01`, the paper's value (LibMTL uses 0.5).

    Example:

    >>> J = np.array([[1.0, 0.0], [-1.0, 1.0]])
    >>> agg = GradVac()
    >>> keras.ops.convert_to_numpy(agg.weights(J @ J.T)).round(4).tolist()
    [2.0, 1.5]
    >>> agg.build(2)
    >>> w, (targets,) = agg.weights_and_state(J @ J.T)
    >>> keras.ops.convert_to_numpy(targets).round(5).tolist()  # beta * cos
    [[0.0, -0.00707], [-0.00707, 0.0]]
    """

    name = "gradvac"
    # `compat.KerasSaveable.__reduce__` pickles through a model file; an aggregator
    # copies and pickles as a plain object.
    __reduce__ = object.__reduce__

    def __init__(self, beta=0.01):
        self.beta = check_number("beta", beta, 0.0, 1.0)
        self._targets = None
        self._pending = None  # targets loaded before `build`

    def build(self, num_tasks):
        """Creates the `[num_tasks, num_tasks]` targets (zeros, or loaded ones).

        Called outside any traced function (the step's shell builds it so
        while tracing: `tf.init_scope` on TensorFlow).

        Args:
            num_tasks: int >= 1, the number of tasks.
        """
        if self._targets is not None and self._targets.shape[0] == num_tasks:
            return
        value = np.zeros([num_tasks] * 2, "float32")
        if self._pending is not None and self._pending.shape == value.shape:
            value = self._pending.astype("float32")
        self._pending = None
        self._targets = keras.Variable(
            value,
            dtype="float32",
            trainable=False,
            autocast=False,
            aggregation="only_first_replica",
            name="gradvac_targets",
        )

    @property
    def state_variables(self):
        return [] if self._targets is None else [self._targets]

    def _current(self, gram):
        num_tasks = gram.shape[0]
        if self._targets is None or self._targets.shape[0] != num_tasks:
            return ops.zeros([num_tasks] * 2, gram.dtype)
        return ops.cast(self._targets.value, gram.dtype)

    def _weights(self, gram):
        return gradvac_weights(gram, self._current(gram), self.beta)[0]

    def weights_and_state(self, gram):
        gram = aggregators._check_gram(gram)
        dtype = _dtype(gram.dtype)
        if dtype in ("float16", "bfloat16"):
            gram = ops.cast(gram, "float32")
        w, targets = gradvac_weights(gram, self._current(gram), self.beta)
        return ops.cast(w, dtype), [ops.cast(targets, "float32")]

    def get_config(self):
        return {"beta": self.beta}

    # Saving: an entry of its own in `.keras` / `.weights.h5` files.
    def _obj_type(self):
        return "Loss"  # a kind Keras' saving walks; no saveable children

    def save_own_variables(self, store):
        if self._targets is not None:
            store["targets"] = self._targets.numpy()

    def load_own_variables(self, store):
        if "targets" not in store.keys():
            return  # saved before training, or by another method
        value = np.asarray(store["targets"], "float32")
        if self._targets is not None and tuple(self._targets.shape) == value.shape:
            self._targets.assign(value)
        else:
            self._pending = value
