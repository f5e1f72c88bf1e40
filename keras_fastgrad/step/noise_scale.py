"""The gradient noise scale, from gradients the step holds anyway.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162), App. A.1: a gradient over `B` independent samples has
`E|G_B|^2 = |G|^2 + tr(Sigma) / B`. Two batch sizes give two equations, and
the unbiased estimators

    |G|^2  = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S      = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

whose ratio, each side smoothed by an exponential moving average,
`B_simple = EMA(S) / EMA(|G|^2)`, is the batch size beyond which larger
batches stop paying (the paper's "simple noise scale").

With accumulation, `micro_batches` or several replicas, every window holds
both: each micro-batch (slice, replica) is a small batch `i` with `n_i`
rows and loss normaliser `D_i`, and the window's gradient
`G_big = sum_i a_i g_i` (`a_i = D_i / sum_j D_j`, `keras_fastgrad.step.
weighting`) is the big one. The step adds up, per window, over the small
batches it keeps (a non-finite one is left out, as from the update)

    sum_i |g_i|^2,   sum_i 1 / n_i,   k      over the k measured ones,
    sum_i D_i^2 / n_i,   sum_i D_i           over all of them

and, at the update, reads `|G_big|^2` (unscaled, before clipping). Every
micro-batch (replica) is measured; with `micro_batches`, the first slice
of each batch only (`slice_measure`: one pass over the gradient per batch,
not per slice). For small batches of `n_i` rows, each `|g_i|^2` has
expectation `|G|^2 + tr(Sigma) / n_i`, so `E[mean_i |g_i|^2] = |G|^2 +
tr(Sigma) s` and `E|G_big|^2 = |G|^2 + tr(Sigma) t` with `s = mean_i 1/n_i`
over the measured ones and `t = sum_i a_i^2 / n_i` over all, so

    |G|^2 = (s |G_big|^2 - t mean_i |g_i|^2) / (s - t)
    S     = (mean_i |g_i|^2 - |G_big|^2) / (s - t)

which is the paper's pair for `k` equal micro-batches (`s = 1/B_small`,
`t = 1/B_big`) and stays unbiased for uneven ones (the epoch's last,
partial batch; the slices of an uneven split). A "batch size" counts rows: the
estimate assumes each row weighs alike in the loss (true for Keras' mean
reductions without sample weights; with per-timestep or per-pixel losses
a row is still one sample). Sample weights are refused (`check_batch`),
as is `reduction="sum"`.

Here, once for both backends: the options' and the batch's refusals, the
telemetry keys, which small batches are measured, the window's state
(`Estimates`, a record of its five values) and how it moves
(`included`, `after_window`, `logs`; the estimators themselves:
`keras_fastgrad.maths.noise_scale`). The variables (`NoiseScale`) are
Keras variables; each backend's shell reads and writes them
(`keras_fastgrad.backend.tensorflow.noise_scale`: replicas, sparse
gradients, one `AssignAdd`; `keras_fastgrad.backend.jax.noise_scale`:
values in Keras' state tuple).
"""

from typing import Any, NamedTuple

import keras
from keras import ops

from keras_fastgrad.maths import noise_scale as maths
from keras_fastgrad.step.variables import global_variable

SIMPLE, GRAD_SQ, TRACE = "gns_simple", "gns_grad_sq", "gns_trace"
KEYS = (SIMPLE, GRAD_SQ, TRACE)
DEFAULT_DECAY = 0.99
MEASURES = maths.MEASURES  # sum |g_i|^2, sum 1/n_i, k, sum D_i^2/n_i, sum D_i
# What a slice past the first adds: its weight, not its squared norm.
WEIGHTS_ONLY = (0.0, 0.0, 0.0, 1.0, 1.0)

small_batch = maths.small_batch  # one small batch's measures (the maths' contract)


def is_key(key):
    """Whether `key` is a noise-scale telemetry key."""
    return key in KEYS


def measurable(options, replicas=1):
    """Whether a step with `options` (a `StepOptions`) on `replicas`
    replicas holds gradients at two batch sizes (accumulation,
    `micro_batches` or several replicas; on JAX, accumulation:
    `keras_fastgrad.backend.jax.noise_scale`) and no task merge (a merged
    gradient is not a sum of the slices' gradients)."""
    if keras.backend.backend() == "jax":  # the window's micro-batches only
        return options.accumulation_steps > 1 and options.multitask is None
    many = options.accumulation_steps > 1 or options.micro_batches > 1 or replicas > 1
    return many and options.multitask is None


def check_measurable(options, replicas=1):
    """Raises unless `measurable(options, replicas)`, naming the fix."""
    if options.multitask is not None:
        raise ValueError(
            "The gradient noise scale (`GradientNoiseScale`, the `gns_*` "
            "telemetry keys) cannot be measured on a multi-task model: its "
            "merged gradient is not a sum of the micro-batches' gradients. "
            f"Received: multitask={options.multitask!r}. Fix: measure the "
            "summed loss (`multitask=None`)."
        )
    if not measurable(options, replicas) and keras.backend.backend() == "jax":
        raise ValueError(
            "The gradient noise scale (`GradientNoiseScale`, the `gns_*` "
            "telemetry keys) needs gradients at two batch sizes; on Keras' "
            "JAX backend, the micro-batches of an accumulation window (not "
            "`micro_batches` slices, nor a `keras.distribution`'s devices). "
            f"Received: accumulation_steps={options.accumulation_steps}, "
            f"micro_batches={options.micro_batches} with "
            "keras.backend.backend()='jax'. Fix: set `accumulation_steps>=2` "
            "(e.g. `FastGradModel(..., accumulation_steps=4)`), or train with "
            "`KERAS_BACKEND=tensorflow`."
        )
    if not measurable(options, replicas):
        raise ValueError(
            "The gradient noise scale (`GradientNoiseScale`, the `gns_*` "
            "telemetry keys) needs gradients at two batch sizes, but each "
            "update of this model uses one batch, whole. Received: "
            f"accumulation_steps={options.accumulation_steps}, "
            f"micro_batches={options.micro_batches}, one replica. Fix: set "
            "`accumulation_steps>=2` or `micro_batches>=2` (e.g. "
            "`FastGradModel(..., micro_batches=4)`, or "
            "`keras_fastgrad.fastgrad(model, micro_batches=4)` for a plain "
            "Keras model), or train under a strategy with several replicas."
        )


def check_batch(sample_weight, mean_reduction):
    """Refuses, at trace time, what would make the estimate silently wrong:
    sample weights (a weighted mean over `n` rows is not a mean of `n`
    equally weighted samples: its variance is not `tr(Sigma) / n`) and a
    `reduction="sum"` loss (its gradient is not a mean)."""
    if sample_weight is not None:
        raise ValueError(
            "The gradient noise scale (`GradientNoiseScale`, the `gns_*` "
            "telemetry keys) counts each row of a batch as one sample and "
            "cannot be measured with sample weights (or `class_weight`). "
            "Received: sample_weight (a tensor). Fix: train without "
            "`sample_weight`/`class_weight` while measuring it."
        )
    if not mean_reduction:
        raise ValueError(
            "The gradient noise scale (`GradientNoiseScale`, the `gns_*` "
            "telemetry keys) needs a loss that averages over the batch. "
            'Received: a loss with reduction="sum". Fix: use the default '
            'reduction ("sum_over_batch_size") while measuring it.'
        )


class Estimates(NamedTuple):
    """The noise scale's state: the window's sums and the moving averages.

    Fields hold values (tensors; `NoiseScale.state()`: its variables, in
    this order).

    Fields:
        window: float32 `(5,)`, the window's summed `small_batch` measures.
        ema_grad_sq: float32 scalar, the EMA of `|G|^2`.
        ema_trace: float32 scalar, the EMA of `tr(Sigma)`.
        ema_weight: float32 scalar, `1 - decay^windows`: the EMAs' bias.
        decay: float32 scalar, the EMAs' decay per window.
    """

    window: Any
    ema_grad_sq: Any
    ema_trace: Any
    ema_weight: Any
    decay: Any


def squared_norm(grads, sum_of_squares=None):
    """`|grads|^2` in float32, `None` for no gradients (`None` entries
    left out). No overflow rescue (unlike `clipping.global_norm`): a square
    beyond float32 is `inf`, and the window's estimate, not finite, is
    skipped.

    Args:
        grads: List of gradients (`None` for a variable without one).
        sum_of_squares: Optional callable, the backend's way to sum the
            squares of a non-empty list of gradients (sparse ones
            included); by default `keras.ops`' square and sum.

    Example:

    >>> float(squared_norm([keras.ops.array([3.0, 4.0]), None]))
    25.0
    """
    parts = [g for g in grads if g is not None]
    if not parts:
        return None
    if sum_of_squares is not None:
        return sum_of_squares(parts)
    squares = [ops.sum(ops.square(ops.cast(g, "float32"))) for g in parts]
    total = squares[0]
    for square in squares[1:]:
        total = total + square
    return total


def small_batch_of(grads, rows, normaliser, sum_of_squares=None):
    """One small batch's measures from its gradients: `small_batch` of
    their `squared_norm` (`sum_of_squares` as there).

    Args:
        grads: Its gradients times `normaliser` (as the step weights
            them), unscaled (`None` entries left out).
        rows: float32 scalar, its number of (real) rows `n`.
        normaliser: float32 scalar, its loss normaliser `D`.

    Example:

    >>> m = small_batch_of([keras.ops.array([6.0, 8.0])], keras.ops.array(4.0), keras.ops.array(2.0))
    >>> [float(v) for v in m]
    [25.0, 0.25, 1.0, 1.0, 2.0]
    """
    return small_batch(squared_norm(grads, sum_of_squares), rows, normaliser)


def weights_only(rows, normaliser):
    """A small batch's measures without its squared norm: only its weight
    (`D^2/n`, `D`) enters the window (`[0, 0, 0, D^2/n, D]`)."""
    return small_batch(None, rows, normaliser) * ops.convert_to_tensor(WEIGHTS_ONLY)


def slice_measure(cond, sum_of_squares=None):
    """The `measure` pair the slices' loop takes (`micro_batches`).

    Each slice adds its weight to the window (`D_i^2 / n_i`, `D_i`), but
    only the first (always full) has its squared norm measured: each small
    batch's is unbiased, and measuring every slice would cost a pass over
    the gradient per slice (about 5% of a step on the benchmark MLP with
    `micro_batches=4`; one per batch stays within 1-2%).

    Args:
        cond: The backend's conditional, `cond(pred, true_fn, false_fn)`.
        sum_of_squares: As in `squared_norm`.

    Returns:
        `(measure, zeros)`: `measure(grads, rows, normaliser, index)`, a
        slice's `(5,)` measures, and the loop's initial sum.
    """

    def measure(grads, rows, normaliser, index):
        return cond(
            index == 0,
            lambda: small_batch_of(grads, rows, normaliser, sum_of_squares),
            lambda: weights_only(rows, normaliser),
        )

    return measure, ops.zeros([MEASURES])


def included(measures, include):
    """What a micro-batch adds to the window: its measures (summed over
    replicas, if several), zeros unless `include` (it is not finite: left
    out, as from the update)."""
    return ops.where(include, measures, ops.zeros_like(measures))


def after_window(state, big_sq, done=None):
    """The `Estimates` after a window's update: both estimates into their
    moving averages (`maths.window_estimate`, `maths.moving_averages`;
    left as they are for a window without an estimate) and an empty window.

    Args:
        state: `Estimates` (values).
        big_sq: float32 scalar, `|G_big|^2` of the window's (global,
            unscaled, unclipped) gradient; `None`: no gradient (0).
        done: Optional boolean scalar: where false, the window is not
            applied and `state` is returned as it was.

    Example (`maths.window_estimate`'s window; decay 0.5):

    >>> zero = keras.ops.array(0.0)
    >>> state = Estimates(keras.ops.array([6.0, 1.0, 2.0, 4.0, 4.0]), zero, zero, zero, 0.5)
    >>> new = after_window(state, keras.ops.array(2.5))
    >>> [float(v) for v in new[1:4]], [float(v) for v in new.window]
    ([1.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0])
    """
    if big_sq is None:
        big_sq = ops.convert_to_tensor(0.0)
    grad_sq, trace, valid = maths.window_estimate(state.window, big_sq)
    if done is not None:
        valid = valid & done
    emas = (state.ema_grad_sq, state.ema_trace, state.ema_weight)
    emas = maths.moving_averages(emas, state.decay, grad_sq, trace, valid)
    empty = ops.zeros_like(state.window)
    window = empty if done is None else ops.where(done, empty, state.window)
    return Estimates(window, *emas, state.decay)


def logs(ema_grad_sq, ema_trace, ema_weight, keys=None):
    """The `gns_*` keys among `keys` (`None`: all): `gns_grad_sq`, `gns_trace` (the
    bias-corrected EMAs) and `gns_simple` (their ratio); NaN before the
    first estimate.

    Example:

    >>> out = logs(2.0, 4.0, keras.ops.array(0.5))
    >>> {k: float(v) for k, v in out.items()}
    {'gns_simple': 2.0, 'gns_grad_sq': 4.0, 'gns_trace': 8.0}
    """
    values = dict(zip(KEYS, maths.logs(ema_grad_sq, ema_trace, ema_weight)))
    return {k: v for k, v in values.items() if k in (KEYS if keys is None else keys)}


class NoiseScale:
    """The noise scale's variables (`Estimates` of them): the window's
    small-batch sums and the EMAs of both estimates. The backend's shell
    reads and writes them in the step.

    Args:
        decay: Float in (0, 1), the EMAs' decay per window (a variable:
            `set_decay` changes it without a retrace).
    """

    NUM_VARIABLES = 5

    def __init__(self, decay=DEFAULT_DECAY):
        self._initial_decay = float(decay)

    def build(self):
        """Creates the state (global float32 variables)."""
        self.decay = global_variable(self._initial_decay, "gns_decay")
        self.window = global_variable([0.0] * MEASURES, "gns_window")
        self.ema_grad_sq = global_variable(0.0, "gns_ema_grad_sq")
        self.ema_trace = global_variable(0.0, "gns_ema_trace")
        # sum of the EMA weights so far (1 - decay^windows): its bias.
        self.ema_weight = global_variable(0.0, "gns_ema_weight")

    def state(self):
        """`Estimates` of the variables."""
        return Estimates(self.window, self.ema_grad_sq, self.ema_trace, self.ema_weight, self.decay)

    @property
    def variables(self):
        """What is saved, in this order (files of earlier releases)."""
        return [self.window, self.ema_grad_sq, self.ema_trace, self.ema_weight, self.decay]

    def reset_state(self):
        """An empty window and no estimate yet (the decay kept)."""
        for v in (self.window, self.ema_grad_sq, self.ema_trace, self.ema_weight):
            v.assign(ops.zeros(v.shape, v.dtype))  # (from the host, on either backend)

    def set_decay(self, decay):
        """Sets the EMAs' decay (from the host)."""
        self.decay.assign(float(decay))

    def logs(self):
        """The `gns_*` keys now, from the host (`logs`)."""
        emas = (self.ema_grad_sq, self.ema_trace, self.ema_weight)
        return logs(*(ops.convert_to_tensor(v.value) for v in emas))
