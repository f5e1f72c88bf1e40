"""`GradientNoiseScale`: the critical batch size, measured by the step from
the gradients it holds at two batch sizes (`keras_fastgrad.step.noise_scale`)."""

import math
import numbers

from keras_fastgrad.callbacks import _base
from keras_fastgrad.callbacks._tensorboard import SummaryWriter
from keras_fastgrad.step import noise_scale
from keras_fastgrad.step.state import replicas_of


class GradientNoiseScale(_base.FastGradCallback):
    """Logs the gradient noise scale `B_simple` (McCandlish et al. 2018).

    `B_simple = tr(Sigma) / |G|^2` is the batch size beyond which larger
    batches stop paying: below it, doubling the batch nearly halves the
    steps needed; above it, it mostly doubles the work. The train step
    measures it for free where it already holds gradients at two batch
    sizes (each micro-batch, slice or replica: the small batch; the
    optimizer update's window: the big one), with the paper's unbiased
    estimators (App. A.1) and exponential moving averages of both,
    in-graph (XLA, `steps_per_execution`, `MirroredStrategy` alike). On
    Keras' JAX backend the small batches are the micro-batches of an
    accumulation window only (`accumulation_steps>=2`; not `micro_batches`
    slices, nor a `keras.distribution`'s devices). Logs:

    - `gns_simple`: `B_simple`, in samples (rows), NaN before the first
      update;
    - `gns_grad_sq`, `gns_trace`: the EMAs of `|G|^2` and `tr(Sigma)`.

    At each epoch's end it prints `B_simple` in words (with `verbose=1`),
    and writes the three values as TensorBoard scalars when
    `tensorboard_dir` is set. `telemetry=True` logs the same keys (where
    they can be measured). See docs/concepts/noise-scale.md.

    Args:
        decay: Float in (0, 1), defaults to `0.99`: the decay per optimizer
            update of the moving averages (the paper smooths both
            estimates: a single window's is very noisy). Use a smaller one
            (e.g. `0.9`) for short runs.
        verbose: Integer 0 or 1, defaults to `1`: print `B_simple` at each
            epoch's end.
        tensorboard_dir: Directory path or `None` (default): also write the
            values as TensorBoard scalars (into `<tensorboard_dir>/train`,
            tags `epoch_gns_simple`, ...).

    Raises:
        ValueError: for invalid arguments; at `fit`, when the step holds
            only one batch size (no `accumulation_steps`, `micro_batches` or
            replicas: set `accumulation_steps>=2` or `micro_batches>=2`;
            on JAX, without `accumulation_steps`),
            for a multi-task model, and, when the step is traced, with
            sample weights or a `reduction="sum"` loss (each row must count
            as one sample).

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> inputs = keras.Input((3,))
    >>> model = keras_fastgrad.FastGradModel(  # (any backend: accumulation)
    ...     inputs, keras.layers.Dense(1)(inputs), accumulation_steps=4)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x = np.random.default_rng(0).normal(size=(64, 3))
    >>> gns = keras_fastgrad.callbacks.GradientNoiseScale(decay=0.5, verbose=0)
    >>> history = model.fit(x, x.sum(1, keepdims=True), batch_size=4,
    ...                     verbose=0, callbacks=[gns])
    >>> sorted(k for k in history.history if k.startswith("gns"))
    ['gns_grad_sq', 'gns_simple', 'gns_trace']
    >>> bool(np.isfinite(gns.b_simple))
    True
    """

    telemetry_keys = noise_scale.KEYS

    def __init__(self, decay=noise_scale.DEFAULT_DECAY, verbose=1, tensorboard_dir=None):
        super().__init__()
        self.decay = check_decay(decay)
        self.verbose = _base.check_int("verbose", verbose, 0, " (0 or 1)")
        self.tensorboard_dir = _base.check_optional_path("tensorboard_dir", tensorboard_dir)
        self.b_simple = float("nan")
        self._writer = None

    def check_model(self, model):
        noise_scale.check_measurable(model.fastgrad_step_state.options, replicas_of(model))
        model.fastgrad_step_state.set_noise_decay(self.decay)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self.tensorboard_dir is not None:
            self._writer = SummaryWriter(self.tensorboard_dir)

    def on_epoch_end(self, epoch, logs=None):
        if not logs or noise_scale.SIMPLE not in logs:
            return
        self.b_simple = float(logs[noise_scale.SIMPLE])
        if self.verbose:
            print(f"Epoch {epoch + 1}: {describe(self.b_simple)}")
        if self._writer is not None:
            values = {k: float(logs[k]) for k in noise_scale.KEYS if k in logs}
            self._writer.scalars(values, epoch, "epoch_")
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        super().on_train_end(logs)


def check_decay(decay):
    """`decay` as a float if it is a number in the open interval (0, 1)
    (1.0 would never move the moving averages from their empty start; 0.0
    would average nothing), else raises `ValueError`."""
    ok = isinstance(decay, numbers.Real) and not isinstance(decay, bool)
    if not (ok and 0.0 < decay < 1.0):
        raise ValueError(
            "`decay` must be a number > 0.0 and < 1.0 (the moving averages' "
            f"decay per update; both ends excluded). Received: decay={decay!r}. "
            "Fix: e.g. `decay=0.99`, or `0.9` for short runs."
        )
    return float(decay)


def describe(b_simple):
    """`B_simple` in words.

    Example:

    >>> describe(250.0)
    'gradient noise scale B_simple ~ 250 samples: optimizer updates over batches much larger than this stop paying (accumulation_steps ~ 250 / batch_size).'
    """
    if not math.isfinite(b_simple):
        return "gradient noise scale not measured yet (no complete optimizer update)."
    if b_simple <= 0.0:
        return (
            f"gradient noise scale B_simple ~ {b_simple:.3g}: not yet reliable "
            "(the moving averages need more updates; try a smaller `decay`)."
        )
    return (
        f"gradient noise scale B_simple ~ {b_simple:.3g} samples: optimizer "
        "updates over batches much larger than this stop paying "
        f"(accumulation_steps ~ {b_simple:.3g} / batch_size)."
    )
