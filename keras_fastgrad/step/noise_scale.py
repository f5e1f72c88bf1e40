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
"""

import keras

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.maths import noise_scale as maths
from keras_fastgrad.step.gradients import summed_rows
from keras_fastgrad.step.replicas import replica_sum
from keras_fastgrad.step.variables import global_variable

SIMPLE, GRAD_SQ, TRACE = "gns_simple", "gns_grad_sq", "gns_trace"
KEYS = (SIMPLE, GRAD_SQ, TRACE)
DEFAULT_DECAY = 0.99
_MEASURES = maths.MEASURES  # sum |g_i|^2, sum 1/n_i, k, sum D_i^2/n_i, sum D_i


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


def squared_norm(grads):
    """`|grads|^2` in float32 (sparse gradients read on their rows,
    duplicates summed), `None` for no gradients. One fused `l2_loss` per
    gradient and no overflow rescue (unlike `clipping.global_norm`): a
    square beyond float32 is `inf`, and the window's estimate, not finite,
    is skipped."""
    parts = [tf.cast(summed_rows(g), tf.float32) for g in grads if g is not None]
    if not parts:
        return None
    return 2.0 * tf.add_n([tf.nn.l2_loss(p) for p in parts])


def small_batch(grads, rows, normaliser):
    """One small batch's measures, `[|g|^2, 1/n, 1, D^2/n, D]` (zeros for a
    batch without rows or with a zero normaliser: left out;
    `keras_fastgrad.maths.noise_scale.small_batch`).

    Args:
        grads: Its gradients times `normaliser` (as the step weights them).
        rows: float32 scalar, its number of (real) rows `n`.
        normaliser: float32 scalar, its loss normaliser `D`.

    Example:

    >>> m = small_batch([tf.constant([6.0, 8.0])], tf.constant(4.0), tf.constant(2.0))
    >>> m.numpy().tolist()  # |(3, 4)|^2, 1/4, 1, 2^2/4, 2
    [25.0, 0.25, 1.0, 1.0, 2.0]
    """
    return maths.small_batch(squared_norm(grads), rows, normaliser)


def slice_measure():
    """The `measure` pair `slicing.sliced_gradients` takes. Each slice
    adds its weight to the window (`D_i^2 / n_i`, `D_i`), but only the
    first (always full) has its squared norm measured: each small batch's
    is unbiased, and measuring every slice would cost a pass over the
    gradient per slice (about 5% of a step on the benchmark MLP with
    `micro_batches=4`; one per batch stays within 1-2%)."""
    weights_only = tf.constant([0.0, 0.0, 0.0, 1.0, 1.0])

    def measure(grads, rows, normaliser, index):
        return tf.cond(
            tf.equal(index, 0),
            lambda: small_batch(grads, rows, normaliser),
            lambda: small_batch([], rows, normaliser) * weights_only,
        )

    return measure, tf.zeros([_MEASURES])


class NoiseScale:
    """The window's small-batch sums and the EMAs of both estimates.

    Args:
        decay: Float in (0, 1), the EMAs' decay per window (a variable:
            `set_decay` changes it without a retrace).

    Example (one window of two small batches, 2 rows each):

    >>> ns = NoiseScale(decay=0.5)
    >>> ns.build()
    >>> ns.record_small(small_batch([tf.constant([2.0, 2.0])], tf.constant(2.0),
    ...                             tf.constant(2.0)), tf.constant(True))
    >>> ns.record_small(small_batch([tf.constant([0.0, 4.0])], tf.constant(2.0),
    ...                             tf.constant(2.0)), tf.constant(True))
    >>> ns.record_window([tf.constant([0.5, 1.5])])  # their weighted mean
    >>> logs = ns.logs()  # small |g|^2 = (2 + 4) / 2, big 2.5, s = 1/2, t = 1/4
    >>> [round(float(logs[k]), 4) for k in KEYS]  # B_simple = 2 / 2
    [1.0, 2.0, 2.0]
    """

    NUM_VARIABLES = 5

    def __init__(self, decay=DEFAULT_DECAY):
        self._initial_decay = float(decay)

    def build(self):
        """Creates the state (global float32 variables)."""
        self.decay = global_variable(self._initial_decay, "gns_decay")
        self.window = global_variable([0.0] * _MEASURES, "gns_window")
        self.ema_grad_sq = global_variable(0.0, "gns_ema_grad_sq")
        self.ema_trace = global_variable(0.0, "gns_ema_trace")
        # sum of the EMA weights so far (1 - decay^windows): its bias.
        self.ema_weight = global_variable(0.0, "gns_ema_weight")

    @property
    def variables(self):
        return [self.window, self.ema_grad_sq, self.ema_trace, self.ema_weight, self.decay]

    def reset_state(self):
        """An empty window and no estimate yet (the decay kept)."""
        for v in (self.window, self.ema_grad_sq, self.ema_trace, self.ema_weight):
            v.assign(keras.ops.zeros(v.shape, v.dtype))  # (from the host, on either backend)

    def set_decay(self, decay):
        """Sets the EMAs' decay (from the host)."""
        self.decay.assign(float(decay))

    def record_small(self, measures, include):
        """Adds this replica's small batch(es) (`small_batch`, summed if
        several) to the window: summed over the replicas, left out unless
        `include` (a non-finite micro-batch). Runs in replica context,
        outside any `cond` (the variables are written once for all)."""
        (measures,) = replica_sum([measures])
        increment(self.window, tf.where(include, measures, tf.zeros_like(measures)))

    def record_window(self, grads):
        """At the update, with the window's (global, unscaled, unclipped)
        gradient: both estimates into their EMAs, and the window restarts.
        A window with fewer than two small batches' worth of spread
        (`s <= t`) or a non-finite estimate leaves the EMAs as they are."""
        big_sq = squared_norm(grads)
        if big_sq is None:
            big_sq = tf.constant(0.0)
        grad_sq, trace, valid = maths.window_estimate(
            tf.convert_to_tensor(self.window.value), big_sq
        )
        emas = (self.ema_grad_sq, self.ema_trace, self.ema_weight)
        values = [tf.convert_to_tensor(v.value) for v in emas]  # (one read each)
        decay = tf.convert_to_tensor(self.decay.value)
        new = maths.moving_averages(values, decay, grad_sq, trace, valid)
        for variable, value in zip(emas, new):
            variable.assign(value)
        self.window.assign(tf.zeros([_MEASURES]))

    def logs(self):
        """`gns_grad_sq`, `gns_trace` (bias-corrected EMAs) and
        `gns_simple` (their ratio); NaN before the first estimate."""
        emas = (self.ema_grad_sq, self.ema_trace, self.ema_weight)
        simple, grad_sq, trace = maths.logs(*(tf.convert_to_tensor(v.value) for v in emas))
        return {SIMPLE: simple, GRAD_SQ: grad_sq, TRACE: trace}
