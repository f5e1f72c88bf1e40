"""BatchNorm moving statistics of the whole window, updated once per window.

`keras.layers.BatchNormalization` in training mode normalises by the
batch's moments and moves its statistics once per call:

    moving_mean     <- moving_mean * momentum + mean * (1 - momentum)
    moving_variance <- moving_variance * momentum + variance * (1 - momentum)

(`variance` the biased, population variance; masked: the mask-weighted
moments). With micro-batches (`accumulation_steps`, `micro_batches`) every
micro-batch would move them: `k` momentum steps from `k` small batches.
Here each layer's moments are pooled over the window instead (Chan, Golub
and LeVeque's parallel combination of `(n, mean, M2)`, `M2 = n * variance`):

    n     = n_a + n_b
    delta = mean_b - mean_a
    mean  = mean_a + delta * n_b / n
    M2    = M2_a + M2_b + delta**2 * n_a * n_b / n

per feature (`n` the mask weights under a mask), over the micro-batch's
slices, its replicas and the window's micro-batches, and the moving
statistics take one step, with the layer's momentum, from the pooled mean
and `M2 / n` (the maths in `keras.ops`, shared with the JAX step:
`keras_fastgrad.maths.batchnorm`): what `keras.Model` does on the
concatenated batch. The
forward pass still normalises each micro-batch by its own moments (ghost
batch normalisation): only the moving statistics are those of the window.

State: per layer, the micro-batch's moments (`scratch`: per replica, not
saved) and the window's (global, saved with the model). A micro-batch that
is dropped (not finite) leaves the window as it was, like its gradient.
"""

import threading

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.maths.batchnorm import (  # (the maths once, in keras.ops)
    chan_combine,  # noqa: F401 (re-exported)
    combined,
    momentum_step,
    pooled,
)
from keras_fastgrad.step.replicas import num_replicas, replica_sum
from keras_fastgrad.step.variables import global_variable

CHOICES = ("window", "micro_batch")


def batchnorm_layers(model):
    """The model's `BatchNormalization` layers (nested ones included)."""
    return [
        layer
        for layer in compat.flatten_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def pools_window(options, layers):
    """Whether the step pools the BatchNorm statistics of `layers` (the
    model's, `batchnorm_layers`) under `options` (a `StepOptions`): the
    option is `"window"`, a batch is split (accumulation or
    `micro_batches`) and there is a BatchNorm layer."""
    split = options.accumulation_steps > 1 or options.micro_batches > 1
    return options.batchnorm_statistics == "window" and split and bool(layers)


class WindowMoments:
    """Per-feature `(n, mean, M2)` of each BatchNorm layer's inputs over a
    window; the moving statistics updated from them once per window.

    Args:
        layers: The built `BatchNormalization` layers.
        sliced: Python bool, the step runs `micro_batches` slices (a
            `tf.while_loop`: their moments are added in variables; else the
            forward pass hands them on as tensors).

    Raises:
        ValueError: for a layer with `renorm=True` (its renormalisation
            moves with every batch: no window equivalent), or one not built.
    """

    def __init__(self, layers, sliced=False):
        for layer in layers:
            _check_layer(layer)
        self.layers = list(layers)
        self.sliced = sliced
        self.sizes = [int(layer.moving_mean.shape[0]) for layer in self.layers]
        self.scratch = {}
        self.window = None
        self._traced = threading.local()  # this thread's trace: moments as tensors

    def build(self):
        """Creates the float32 state: the window's `[3, features]` moments
        (`n`, `mean`, `M2`, all layers side by side; global), and with
        slices each layer's micro-batch moments (per replica)."""
        self.window = global_variable(
            keras.ops.zeros([3, sum(self.sizes)]), "batchnorm_window_moments"
        )
        if self.sliced:
            self.scratch = {
                id(layer): compat.variable(
                    keras.ops.zeros([3, size]),
                    trainable=False,
                    autocast=False,
                    synchronization="on_read",
                    aggregation="sum",
                    name=f"batchnorm_{i}_micro_moments",
                )
                for i, (layer, size) in enumerate(zip(self.layers, self.sizes))
            }

    @property
    def variables(self):
        """The window's state (what is saved)."""
        return [self.window]

    def reset_state(self):
        """An empty window (nothing pooled yet)."""
        self.window.assign(keras.ops.zeros(self.window.shape, self.window.dtype))  # (from the host)

    # ------------------------------------------------- in the forward pass
    def recording(self):
        """A context for the step's forward pass: each layer's training
        moments are added to its micro-batch moments, and its moving
        statistics stay where they are (they move in `apply`).

        Raises:
            ValueError: (while tracing) for a layer that assigns its moving
                statistics without Keras' moments computation (a subclass
                with a `call` of its own): nothing would be pooled."""
        self._traced.moments = {}
        recorded = set()

        def record(layer, *moments):
            recorded.add(id(layer))
            self._record(layer, *moments)

        def held(layer):
            if id(layer) not in recorded:
                _refuse_unrecorded(layer)

        return compat.batchnorm_recording(self.layers, record, held)

    def _record(self, layer, inputs, mask, mean, variance):
        # Keras' moments are the micro-batch's (or slice's: no padding)
        n = _counts(layer, inputs, mask)
        mean = tf.reshape(tf.cast(mean, tf.float32), [-1])
        m2 = tf.reshape(tf.cast(variance, tf.float32), [-1]) * n
        moments = tf.stop_gradient(tf.stack([n, mean, m2]))
        if self.sliced:
            scratch = self.scratch[id(layer)]
            scratch.assign(combined(tf.convert_to_tensor(scratch.value), moments))
            return
        traced = self._traced.moments  # several calls of a layer: all pooled
        before = traced.get(id(layer))
        traced[id(layer)] = moments if before is None else combined(before, moments)

    # ------------------------------------------------ after the finite check
    def end_micro_batch(self, keep):
        """Adds the micro-batch's moments, pooled over the replicas (two
        small all-reduces with several), to the window if `keep`. Runs in
        replica context, on every replica."""
        local = tf.concat(
            [self._micro_batch_moments(l, s) for l, s in zip(self.layers, self.sizes)], 1
        )
        if num_replicas() > 1:
            local = _pooled_over_replicas(local)
        current = tf.convert_to_tensor(self.window.value)
        self.window.assign(tf.where(keep, combined(current, local), current))

    def _micro_batch_moments(self, layer, size):
        """The layer's `[3, size]` moments of this micro-batch (zeros if it
        took none); a slices' sum is emptied for the next one."""
        if self.sliced:
            scratch = self.scratch[id(layer)]
            moments = tf.convert_to_tensor(scratch.value)
            with tf.control_dependencies([moments]):
                scratch.assign(tf.zeros([3, size]))
            return moments
        moments = getattr(self._traced, "moments", {}).get(id(layer))
        return tf.zeros([3, size]) if moments is None else moments

    # ------------------------------------------------------- at the update
    def apply(self):
        """One momentum step of each layer's moving statistics from the
        window's pooled moments (features without samples keep theirs),
        then empties the window. Runs with the optimizer update."""
        has_samples, mean, variance = pooled(tf.convert_to_tensor(self.window.value))
        parts = zip(*(tf.split(t, self.sizes) for t in (has_samples, mean, variance)))
        for layer, (has_samples, mean, variance) in zip(self.layers, parts):
            for moving, new in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                old = tf.convert_to_tensor(moving.value)
                moving.assign(momentum_step(old, new, has_samples, layer.momentum))
        self.window.assign(tf.zeros(self.window.shape))


def _check_layer(layer):
    if not layer.built:
        raise ValueError(
            f"`batchnorm_statistics='window'` needs the BatchNormalization "
            f"layer `{layer.name}` built before training. Received: an "
            "unbuilt layer. Fix: build the model (call it on a batch) "
            "before `fit`."
        )
    if getattr(layer, "renorm", False):  # (absent from older Keras)
        raise ValueError(
            f"`batchnorm_statistics='window'` cannot pool the BatchNormalization "
            f"layer `{layer.name}`: with `renorm=True` its renormalisation "
            "statistics move with every batch it sees. Received: renorm=True. "
            "Fix: pass `batchnorm_statistics='micro_batch'` (each micro-batch "
            "moves the statistics, as `keras.Model` does per batch)."
        )


def _refuse_unrecorded(layer):
    raise ValueError(
        f"`batchnorm_statistics='window'` cannot pool the BatchNormalization "
        f"layer `{layer.name}` ({type(layer).__name__}): it updates its moving "
        "statistics without Keras' moments computation. Fix: pass "
        "`batchnorm_statistics='micro_batch'`."
    )


def _counts(layer, inputs, mask):
    """The samples behind each feature's moments: the positions reduced
    over, or (masked, as Keras weighs them) the mask's weights."""
    axis = layer.axis % len(inputs.shape)
    features = tf.shape(inputs)[axis]
    if mask is None:
        count = tf.cast(tf.size(inputs) // features, tf.float32)
        return tf.fill([features], count)
    weights = tf.broadcast_to(tf.cast(mask, tf.float32)[..., None], tf.shape(inputs))
    axes = [a for a in range(len(inputs.shape)) if a != axis]
    return tf.reduce_sum(weights, axis=axes)


def _pooled_over_replicas(local):
    """The `[3, features]` moments over all replicas: the k-group form of
    Chan's combination, `mean = sum n_r mean_r / N`, `M2 = sum (M2_r +
    n_r (mean_r - mean)**2)` (two all-reduces, all layers together). A
    `synchronized=True` layer's replicas each hold the global moments with
    their own count: the same formula gives them back."""
    n, mean, m2 = tf.unstack(local)
    total, weighted = replica_sum([n, n * mean])
    global_mean = tf.math.divide_no_nan(weighted, total)
    (spread,) = replica_sum([m2 + n * tf.square(mean - global_mean)])
    return tf.stack([total, global_mean, spread])


def check_synchronized_slices(layers, micro_batches, strategy):
    """Refuses `micro_batches` with a `BatchNormalization(synchronized=True)`
    layer under a distribution strategy, before the step is traced.

    The layer all-reduces its moments across replicas (a `merge_call`) in
    every forward pass; inside the slices' `tf.while_loop` TensorFlow
    refuses that with a `RuntimeError` ("`merge_call` called while defining
    a new graph"), with one replica too. Without a strategy, and with
    `accumulation_steps` (no loop), the layer runs.

    Args:
        layers: The model's BatchNorm layers (`batchnorm_layers`).
        micro_batches: The `micro_batches` option.
        strategy: The model's `distribute_strategy`.

    Raises:
        ValueError: naming the layer and both fixes.
    """
    if micro_batches <= 1:
        return
    synchronized = [layer for layer in layers if getattr(layer, "synchronized", False)]
    if not synchronized:
        return
    with strategy.scope():  # (the default strategy's scope is no strategy)
        if not tf.distribute.has_strategy():
            return
    m = micro_batches
    raise ValueError(
        f"`micro_batches` cannot run the BatchNormalization layer "
        f"`{synchronized[0].name}` with `synchronized=True` under "
        f"`{type(strategy).__name__}`: the layer all-reduces its moments "
        "across replicas in each forward pass, and TensorFlow refuses that "
        "inside the slices' loop (`merge_call` called while defining a new "
        f"graph). Received: micro_batches={m}, synchronized=True. Fix: "
        "`BatchNormalization(synchronized=False)` (each replica's slices "
        "are normalised by their own moments; with "
        "`batchnorm_statistics='window'` the moving statistics are still "
        f"pooled over every replica), or `accumulation_steps={m}` with a "
        f"batch size {m} times smaller instead of `micro_batches={m}` (each "
        "micro-batch a whole batch, normalised across the replicas)."
    )
