"""Multi-task gradient aggregators in coefficient space.

`T` task gradients flattened into `J` (`T x P`) are merged as `w^T J`; an
aggregator only sees the Gram matrix `G = J J^T` (`T x T`, `T` static) and
returns the task weights `w` (`[T]`, the dtype of `G`). All of them are pure
TensorFlow: they trace in graph mode and compile with
`tf.function(jit_compile=True)`.

Example:

>>> import tensorflow as tf
>>> from keras_fastgrad import aggregators
>>> J = tf.constant([[1.0, 0.0], [-1.0, 1.0]], tf.float64)  # 2 tasks, P = 2
>>> gram = tf.matmul(J, J, transpose_b=True)
>>> w = aggregators.get("mgda").weights(gram)
>>> w.numpy().round(4).tolist()
[0.6, 0.4]
>>> tf.linalg.matvec(J, w, transpose_a=True).numpy().round(4).tolist()  # w^T J
[0.2, 0.4]
>>> int(aggregators.gram_telemetry(gram)["num_conflicts"])
1
"""

import keras
import tensorflow as tf

from keras_fastgrad.aggregators import _solvers
from keras_fastgrad.aggregators._base import (  # noqa: F401 (Aggregator: public)
    Aggregator,
    _check_gram,
    _check_int,
    _register,
)
from keras_fastgrad.aggregators._solvers import pcgrad_weights  # noqa: F401 (public)

# The newer methods live in modules of their own.
from keras_fastgrad.aggregators._cone import ConFIG, DualProj, UPGrad
from keras_fastgrad.aggregators._gradvac import GradVac
from keras_fastgrad.aggregators._nashmtl import NashMTL

NAMES = (
    "aligned", "cagrad", "config", "dualproj", "gradvac", "imtl", "mean", "mgda",
    "nashmtl", "pcgrad", "sum", "upgrad",
)
@_register
class Sum(Aggregator):
    """Plain sum of the task gradients: `w = 1`.

    Example:

    >>> Sum().weights(tf.eye(3)).numpy().tolist()
    [1.0, 1.0, 1.0]
    """

    name = "sum"

    def _weights(self, gram, seed_tensor):
        return tf.ones([gram.shape[0]], gram.dtype)


@_register
class Mean(Aggregator):
    """Mean of the task gradients: `w = 1/T`.

    Example:

    >>> Mean().weights(tf.eye(4)).numpy().tolist()
    [0.25, 0.25, 0.25, 0.25]
    """

    name = "mean"

    def _weights(self, gram, seed_tensor):
        return tf.fill([gram.shape[0]], tf.constant(1.0 / gram.shape[0], gram.dtype))


@_register
class PCGrad(Aggregator):
    """PCGrad, "Gradient Surgery for Multi-Task Learning" (Yu et al., NeurIPS 2020).

    Algorithm 1: for each task `i`, `g_i^PC = g_i`; for each other task `j`
    in a fresh random order, if `<g_i^PC, g_j> < 0` then
    `g_i^PC <- g_i^PC - <g_i^PC, g_j> / ||g_j||^2 g_j`. The merged gradient
    is `sum_i g_i^PC`. Computed on coefficients (`g_i^PC = c_i^T J`, see
    `pcgrad_weights`); `w = sum_i c_i`. Each call draws new orders from the
    aggregator's `keras.random.SeedGenerator` (a variable: also new orders
    per call under `tf.function(jit_compile=True)`; build the aggregator
    outside any `tf.function`) or, if given, from the stateless int `[2]`
    `seed_tensor`; `orders` (int `[T, T-1]`, row `i` the visiting order of
    task `i`) fixes them.

    Args:
        seed: int or None, the seed of the generator.

    Example:

    >>> J = tf.constant([[-10.0, 0.0], [1.0, -1.0]], tf.float64)  # tug of war
    >>> gram = tf.matmul(J, J, transpose_b=True)
    >>> PCGrad(seed=0).weights(gram).numpy().round(4).tolist()
    [1.1, 6.0]
    >>> gram3 = tf.eye(3, dtype=tf.float64) - 0.2  # three conflicting tasks
    >>> orders = [[1, 2], [0, 2], [0, 1]]  # task 0 visits 1 then 2, ...
    >>> PCGrad().weights(gram3, orders=orders).numpy().round(4).tolist()
    [1.5, 1.5625, 1.625]
    """

    name = "pcgrad"

    def __init__(self, seed=None):
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def weights(self, gram, seed_tensor=None, orders=None):
        """As `Aggregator.weights`; `orders` (int `[T, T-1]`) fixes the order."""
        if orders is None:
            return super().weights(gram, seed_tensor)
        orders = tf.convert_to_tensor(orders)
        num_tasks = _check_gram(gram).shape[0]
        if orders.shape != (num_tasks, num_tasks - 1):
            raise ValueError(
                f"`orders` must have shape ({num_tasks}, {num_tasks - 1}) for "
                f"{num_tasks} tasks. Received: orders.shape={orders.shape}"
            )
        return self._run(gram, lambda g: pcgrad_weights(g, orders))

    def _weights(self, gram, seed_tensor):
        shape = [gram.shape[0]] * 2
        if seed_tensor is None:
            uniform = keras.random.uniform(shape, seed=self.seed_generator)
        else:
            uniform = tf.random.stateless_uniform(shape, seed=seed_tensor)
        return pcgrad_weights(gram, _solvers.random_orders(shape[0], uniform))

    def get_config(self):
        return {"seed": self.seed}


@_register
class MGDA(Aggregator):
    """MGDA-UB (Sener & Koltun, NeurIPS 2018).

    "Multi-Task Learning as Multi-Objective Optimization":
    `w = argmin_{w in simplex} w^T G w`, the min-norm point of the convex
    hull of the task gradients. Solved by Frank-Wolfe in Gram space from
    `w = 1/T` with exact line search (Algorithm 2), using pairwise steps
    (move mass from the worst active task to the best one), which converge
    linearly where plain Frank-Wolfe steps are O(1/k); the loop stops once
    the duality gap is at rounding level, or after `max_iter` steps. An
    exact active-set solve of the simplex QP, started from that point,
    then lands on the KKT point (`_solvers.min_norm_weights`), also when
    the task gradients' norms are orders of magnitude apart.

    Args:
        max_iter: int, the cap on the solver steps.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> MGDA().weights(gram).numpy().round(4).tolist()
    [0.2, 0.8]
    """

    name = "mgda"

    def __init__(self, max_iter=1000):
        self.max_iter = _check_int("max_iter", max_iter, 1)

    def _weights(self, gram, seed_tensor):
        return _solvers.min_norm_weights(gram, self.max_iter)

    def get_config(self):
        return {"max_iter": self.max_iter}


@_register
class CAGrad(Aggregator):
    """CAGrad (Liu et al., NeurIPS 2021).

    "Conflict-Averse Gradient Descent for Multi-task Learning", as the
    official `cagrad` function: `g0` the mean gradient,
    `c' = c ||g0|| + 1e-8`,
    `w = argmin_{w in simplex} w^T G 1/T + c' sqrt(w^T G w + 1e-8)`,
    `g = (g0 + c' / ||w^T J|| w^T J) / (1 + c^2)` (`rescale=1`; `rescale=2`
    divides by `1 + c`, `rescale=0` not at all). The simplex problem is
    solved in-graph (pairwise Frank-Wolfe, exact line search) instead of
    scipy's SLSQP. `c=0` gives the mean. Computed in units of
    `max(diag G)` with the official `1e-8` constants rescaled alike: the
    same weights, without overflow for float32 Grams up to `~1e36`
    (`_solvers.cagrad_weights`).

    Args:
        c: float >= 0, the radius of the conflict-averse ball.
        rescale: 0, 1 or 2.
        max_iter: int, the cap on the solver steps.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> CAGrad(c=0.5).weights(gram).numpy().round(4).tolist()
    [0.4, 0.8472]
    >>> CAGrad(c=0.0).weights(gram).numpy().round(4).tolist()
    [0.5, 0.5]
    """

    name = "cagrad"

    def __init__(self, c=0.5, rescale=1, max_iter=1000):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0:
            raise ValueError(f"`c` must be a number >= 0. Received: c={c!r}")
        if rescale not in (0, 1, 2) or isinstance(rescale, bool):
            raise ValueError(
                f"`rescale` must be 0, 1 or 2. Received: rescale={rescale!r}"
            )
        self.c, self.rescale = float(c), rescale
        self.max_iter = _check_int("max_iter", max_iter, 1)

    def _weights(self, gram, seed_tensor):
        return _solvers.cagrad_weights(gram, self.c, self.rescale, self.max_iter)

    def get_config(self):
        return {"c": self.c, "rescale": self.rescale, "max_iter": self.max_iter}


@_register
class IMTL(Aggregator):
    """IMTL-G (Liu et al., ICLR 2021), generalised as torchjd's `IMTLG`.

    "Towards Impartial Multi-task Learning": the merged gradient
    `g = sum_t w_t g_t`, `sum_t w_t = 1`, has equal projections on every
    unit task gradient `u_t = g_t / ||g_t||`. In Gram space
    `G w = c d` with `d = sqrt(diag G)` the gradient norms, so
    `w = G^+ d / sum(G^+ d)`: at full rank exactly the paper's closed form,
    and with the pseudo-inverse `(.)^+` (cut-off `T eps(dtype)` relative, as
    numpy) the generalisation of Quinton & Rey, "Jacobian Descent for
    Multi-Objective Optimization" (2024) to dependent gradients. A task
    whose gradient is zero gets weight 0 and the others are balanced among
    themselves; if `sum(G^+ d)` vanishes (e.g. `G = 0`) every weight is 0.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> IMTL().weights(gram).numpy().round(4).tolist()
    [0.3333, 0.6667]
    >>> zero_task = tf.constant([[4.0, 0.0], [0.0, 0.0]], tf.float64)
    >>> IMTL().weights(zero_task).numpy().tolist()  # task 2 has no gradient
    [1.0, 0.0]
    """

    name = "imtl"

    def _weights(self, gram, seed_tensor):
        return _solvers.imtl_weights(gram)


@_register
class AlignedMTL(Aggregator):
    """Aligned-MTL (Senushkin et al., CVPR 2023).

    "Independent Component Alignment for Multi-Task Learning":
    `G = V L V^T`, `B = sqrt(l_min) V L^{-1/2} V^T` over the non-zero
    eigenvalues (the official rank rule: `> max(L) T eps_float32`), `l_min`
    the smallest of them; `w = B omega` with the task
    pre-weights `omega` (ones, as the official `AlignedMTLBalancer`, which
    sums the aligned gradients). The aligned gradients `J^T B` are
    orthogonal with equal norms (`B G B = l_min I` at full rank). A
    non-finite `G` (a NaN sample) gives NaN weights, never an `eigh` error,
    so the train step's finite check drops the micro-batch.

    Args:
        task_weights: None (ones) or a list of `T` floats, `omega`.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> AlignedMTL().weights(gram).numpy().round(4).tolist()
    [0.5, 1.0]
    >>> AlignedMTL().weights([[float("nan"), 0.0], [0.0, 1.0]]).numpy().tolist()
    [nan, nan]
    """

    name = "aligned"

    def __init__(self, task_weights=None):
        if task_weights is not None:
            task_weights = [float(x) for x in task_weights]
        self.task_weights = task_weights

    def balance_matrix(self, gram):
        """The `[T, T]` matrix `B`: the aligned task gradients are `B^T J`."""
        return _solvers.aligned_balance_matrix(_check_gram(gram))

    def _weights(self, gram, seed_tensor):
        omega = tf.ones([gram.shape[0]], gram.dtype)
        if self.task_weights is not None:
            if len(self.task_weights) != gram.shape[0]:
                raise ValueError(
                    "`task_weights` must have one entry per task. Received: "
                    f"task_weights={self.task_weights} for {gram.shape[0]} tasks"
                )
            omega = tf.constant(self.task_weights, gram.dtype)
        return tf.linalg.matvec(_solvers.aligned_balance_matrix(gram), omega)

    def get_config(self):
        return {"task_weights": self.task_weights}


_CLASSES = {
    c.name: c
    for c in (
        Sum, Mean, PCGrad, MGDA, CAGrad, IMTL, AlignedMTL,
        UPGrad, DualProj, ConFIG, GradVac, NashMTL,
    )
}


def serialize(aggregator):
    """The Keras config dict of `aggregator` (`get` rebuilds it).

    Args:
        aggregator: An `Aggregator` instance.

    Returns:
        A JSON-serializable dict.

    Example:

    >>> config = serialize(get("cagrad"))
    >>> type(get(config)).__name__, get(config).c
    ('CAGrad', 0.5)
    """
    return keras.saving.serialize_keras_object(aggregator)


def get(identifier):
    """An `Aggregator` from a name in `NAMES`, an instance or a config dict.

    Args:
        identifier: A name from `NAMES` (case-insensitive), an `Aggregator`
            instance (returned as is), a config dict from `serialize`, or
            `None` (no aggregation, returned as `None`, as in Keras' `get`
            functions).

    Returns:
        An `Aggregator` or `None`.

    Raises:
        ValueError: for anything else, listing the valid names.

    Example:

    >>> type(get("pcgrad")).__name__
    'PCGrad'
    >>> get("pcgard")
    Traceback (most recent call last):
    ...
    ValueError: `multitask` must be one of [...] or an Aggregator instance. Received: multitask='pcgard'
    """
    if identifier is None or isinstance(identifier, Aggregator):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _CLASSES:
        return _CLASSES[identifier.lower()]()
    if isinstance(identifier, dict):
        name = str(identifier.get("class_name", "")).lower()
        if name in _CLASSES:
            return _CLASSES[name].from_config(identifier.get("config") or {})
        try:
            obj = keras.saving.deserialize_keras_object(identifier)
        except (TypeError, ValueError) as e:
            raise ValueError(
                "`multitask` config could not be deserialized into an "
                f"Aggregator. Received: multitask={identifier!r}"
            ) from e
        if isinstance(obj, Aggregator):
            return obj
    raise ValueError(
        f"`multitask` must be one of {list(NAMES)} or an Aggregator instance. "
        f"Received: multitask={identifier!r}"
    )


def gram_telemetry(gram):
    """Per-task gradient norms, pairwise cosines and conflicts from `G`.

    Args:
        gram: `[T, T]` Gram matrix `J J^T` of the task gradients.

    Returns:
        A dict: `"norms"` (`[T]`, `sqrt(diag G)`), `"cosine"` (`[T, T]`, 0
        where a norm is 0) and `"num_conflicts"` (int32, pairs `i < j` with
        `G_ij < 0`).

    Example:

    >>> t = gram_telemetry(tf.constant([[4.0, -2.0], [-2.0, 4.0]]))
    >>> t["norms"].numpy().tolist(), float(t["cosine"][0, 1]), int(t["num_conflicts"])
    ([2.0, 2.0], -0.5, 1)
    """
    gram = _check_gram(gram)
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    positive = norms > 0
    inv = tf.where(positive, 1.0 / tf.where(positive, norms, tf.ones_like(norms)), 0.0)
    cosine = gram * inv[:, None] * inv[None, :]
    ones = tf.ones_like(gram)
    upper = tf.linalg.band_part(ones, 0, -1) - tf.linalg.band_part(ones, 0, 0)
    conflicts = tf.reduce_sum(tf.cast((gram < 0) & (upper > 0), tf.int32))
    return {"norms": norms, "cosine": cosine, "num_conflicts": conflicts}
