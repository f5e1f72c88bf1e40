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
and `M2 / n` (the maths: `keras_fastgrad.maths.batchnorm`): what
`keras.Model` does on the concatenated batch. The forward pass still
normalises each micro-batch by its own moments (ghost batch
normalisation): only the moving statistics are those of the window.

State: per layer, the micro-batch's moments (`scratch`: per replica, not
saved) and the window's (global, saved with the model). A micro-batch that
is dropped (not finite) leaves the window as it was, like its gradient.

Here, once for both backends: the choices and their refusals, the moments a
forward pass records (`Recorder`), their pooling over replicas and the
window (`pooled_over_replicas`, `kept`), and the moving statistics' step
(`moved`). The shells say how the state is held and written
(`keras_fastgrad.backend.tensorflow.batchnorm`: variables, replicas, the
slices' loop; `keras_fastgrad.backend.jax.batchnorm`: Keras' state tuple).
"""

import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.maths.batchnorm import (  # (the maths once, in keras.ops)
    chan_combine,  # noqa: F401 (re-exported)
    combined,
    counts,
    moments_stack,
    momentum_step,
    pooled,
)
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
    """The variables of the pooled moments: the window's and, with slices,
    each layer's micro-batch moments (the shells read and write them).

    Args:
        layers: The built `BatchNormalization` layers.
        sliced: Python bool, the step runs `micro_batches` slices (on
            TensorFlow a `tf.while_loop`: their moments are added in
            variables; else the forward pass hands them on as tensors).

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

    def build(self):
        """Creates the float32 state: the window's `[3, features]` moments
        (`n`, `mean`, `M2`, all layers side by side; global), and with
        slices each layer's micro-batch moments (per replica)."""
        self.window = global_variable(ops.zeros([3, sum(self.sizes)]), "batchnorm_window_moments")
        if self.sliced:
            self.scratch = {
                id(layer): compat.variable(
                    ops.zeros([3, size]),
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
        self.window.assign(ops.zeros(self.window.shape, self.window.dtype))  # (from the host)


def layer_moments(layer, inputs, mask, mean, variance):
    """The `[3, features]` float32 `(n, mean, M2)` of one call of `layer`
    in training mode (Keras' batch moments `mean`, `variance`; `n` the
    positions reduced over, or the mask's weights), outside the gradient."""
    n = counts(inputs, mask, layer.axis)
    return ops.stop_gradient(moments_stack(n, mean, variance))


class Recorder:
    """The moments one forward pass records, per layer; several calls of a
    layer are pooled.

    Args:
        layers: The `BatchNormalization` layers pooled.
        store: Optional callable `store(layer, moments)` that keeps a
            call's moments instead (TensorFlow's slices: in a variable).
    """

    def __init__(self, layers, store=None):
        self.layers = list(layers)
        self.moments = {}
        self._store = store
        self._recorded = set()

    def record(self, layer, inputs, mask, mean, variance):
        """Keeps the moments of one call of `layer` (`layer_moments`)."""
        moments = layer_moments(layer, inputs, mask, mean, variance)
        self._recorded.add(id(layer))
        if self._store is not None:
            self._store(layer, moments)
            return
        before = self.moments.get(id(layer))
        self.moments[id(layer)] = moments if before is None else combined(before, moments)

    def held(self, layer):
        """Refuses a layer that held its moving statistics without
        recording (`refuse_unrecorded`)."""
        if id(layer) not in self._recorded:
            refuse_unrecorded(layer)

    def recording(self):
        """A context for a forward pass: each layer's training moments are
        recorded and its moving statistics stay where they are (they move
        with the window, `moved`).

        Raises:
            ValueError: (while tracing) for a layer that assigns its moving
                statistics without Keras' moments computation (a subclass
                with a `call` of its own): nothing would be pooled."""
        return compat.batchnorm_recording(self.layers, self.record, self.held)

    def stacked(self, sizes):
        """`[3, sum(sizes)]`: every layer's recorded moments side by side
        (zeros for a layer that took none)."""
        return ops.concatenate(
            [
                self.moments.get(id(layer), ops.zeros((3, size), "float32"))
                for layer, size in zip(self.layers, sizes)
            ],
            axis=1,
        )


def pooled_over_replicas(local, replica_sum):
    """The `[3, features]` moments over all replicas: the k-group form of
    Chan's combination, `mean = sum n_r mean_r / N`, `M2 = sum (M2_r +
    n_r (mean_r - mean)**2)`. A `synchronized=True` layer's replicas each
    hold the global moments with their own count: the same formula gives
    them back.

    Args:
        local: This replica's `[3, features]` moments.
        replica_sum: The backend's sum over the replicas of a list of
            tensors (two calls, all layers together).

    Example (two replicas holding the same samples `[1, 3]` of one feature:
    the four samples `[1, 3, 1, 3]`, mean 2, `M2` 4):

    >>> local = np.array([[2.0], [2.0], [2.0]], "float32")  # n 2, mean 2, M2 2
    >>> def replica_sum(values):  # two replicas, equal values
    ...     return [2.0 * v for v in values]
    >>> [float(v[0]) for v in pooled_over_replicas(local, replica_sum)]
    [4.0, 2.0, 4.0]
    """
    n, mean, m2 = ops.unstack(local, 3)
    total, weighted = replica_sum([n, n * mean])
    global_mean = ops.divide_no_nan(weighted, total)
    (spread,) = replica_sum([m2 + n * ops.square(mean - global_mean)])
    return ops.stack([total, global_mean, spread])


def kept(keep, with_micro_batch, without):
    """The window after a micro-batch: `with_micro_batch` (its moments
    combined in) where `keep`, `without` where it is dropped (not finite:
    left out, like its gradient)."""
    if keep is True:
        return with_micro_batch
    return ops.where(keep, with_micro_batch, without)


def moved(window, layers, sizes, moving, complete=None, split=None):
    """One momentum step of each layer's moving statistics from the
    window's pooled moments (features without samples keep theirs), and
    the window emptied.

    Args:
        window: `[3, sum(sizes)]` float32, the window's moments.
        layers: The `BatchNormalization` layers (their `momentum`).
        sizes: Their feature counts.
        moving: Per layer, the values `(moving_mean, moving_variance)`.
        complete: Optional boolean scalar: where false, nothing moves and
            the window stays.
        split: Optional callable `split(tensor, sizes)`, the backend's
            split of a `[sum(sizes)]` tensor into the layers' parts (by
            default, slices).

    Returns:
        `(new_moving, new_window)`: per layer the new pair, and the window.

    Example (one layer of one feature: 4 samples, mean 2, variance 3):

    >>> window = np.array([[4.0], [2.0], [12.0]], "float32")
    >>> layer = keras.layers.BatchNormalization(momentum=0.5)
    >>> ((mean, var),), empty = moved(window, [layer], [1], [(np.zeros(1), np.ones(1))])
    >>> float(mean[0]), float(var[0]), float(empty[0, 0])
    (1.0, 2.0, 0.0)
    """
    parts = [_parts(t, sizes, split) for t in pooled(window)]
    new_moving = []
    for layer, pair, (has_samples, mean, variance) in zip(layers, moving, zip(*parts)):
        new_pair = []
        for old, new in zip(pair, (mean, variance)):
            value = momentum_step(old, new, has_samples, layer.momentum)
            new_pair.append(value if complete is None else ops.where(complete, value, old))
        new_moving.append(tuple(new_pair))
    empty = ops.zeros_like(window)
    return new_moving, (empty if complete is None else ops.where(complete, empty, window))


def _parts(tensor, sizes, split):
    if len(sizes) == 1:
        return [tensor]
    if split is not None:
        return split(tensor, sizes)
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return [tensor[end - size : end] for size, end in zip(sizes, ends)]


def completes_window(micro_step, accumulation_steps):
    """Whether the moving statistics move after this micro-step: `None`
    (every step) without accumulation (`micro_step` `None`), else whether
    `micro_step` (counted from 1) ends a window. The partial window at an
    epoch's end moves them once more."""
    if micro_step is None:
        return None
    return ops.equal(micro_step % accumulation_steps, 0)


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


def refuse_unrecorded(layer):
    """Raises: a layer updated its moving statistics without Keras'
    moments computation (nothing recorded to pool)."""
    raise ValueError(
        f"`batchnorm_statistics='window'` cannot pool the BatchNormalization "
        f"layer `{layer.name}` ({type(layer).__name__}): it updates its moving "
        "statistics without Keras' moments computation. Received: a call that "
        "assigned `moving_mean`/`moving_variance` with no moments recorded. "
        "Fix: pass `batchnorm_statistics='micro_batch'`."
    )


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
        strategy: The model's `distribute_strategy` (`None`: none, as on
            Keras' JAX backend; TensorFlow's default strategy is none).

    Raises:
        ValueError: naming the layer and both fixes.
    """
    if micro_batches <= 1:
        return
    synchronized = [layer for layer in layers if getattr(layer, "synchronized", False)]
    if not synchronized:
        return
    if strategy is None or compat.is_default_strategy(strategy):
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
