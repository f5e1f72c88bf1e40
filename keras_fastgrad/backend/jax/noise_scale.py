"""The gradient noise scale in the JAX step (`GradientNoiseScale`, the
`gns_*` telemetry keys), on values.

The rules, the estimators and the keys, once for both backends:
`keras_fastgrad.step.noise_scale` (and `keras_fastgrad.maths.noise_scale`).
Each
micro-batch of an accumulation window is a small batch (its gradient times
its loss normaliser `D_i`, unscaled, as the window adds it up; a
non-finite one is left out), the window's gradient at its update
(unscaled, unclipped) the big one, and the moving averages of `|G|^2` and
`tr(Sigma)` move once per applied window. The state is `NoiseScale`'s
variables (the window's five sums, the three EMAs, the decay), threaded
through Keras' state tuple with the step's others (`jax_state.Slots`):
each function here reads them from the step's `StepValues` as a
`noise_scale.Estimates`, and replaces it with the new values.

On JAX the small batches are the accumulation window's micro-batches
only: under `micro_batches` a micro-batch's slices are not measured apart
(its whole batch is the small batch), and under
`keras.distribution.DataParallel` neither are the devices' shards (the
arrays are global). Without accumulation nothing is measurable
(`noise_scale.measurable`).
"""

from keras import ops

from keras_fastgrad.step import noise_scale
from keras_fastgrad.step.splitting import first_input


def measured(model):
    """Whether the step measures the noise scale (a `gns_*` key asked)."""
    return model.fastgrad_step_state.noise_scale is not None


def record_small(model, new, grads, x, normaliser, include, batch):
    """Adds the micro-batch (one small batch) to the window, unless not
    `include` (a non-finite micro-batch); a no-op when not measured.

    Args:
        model: The `FastGradModel`.
        new: The step's `StepValues` (its `noise` replaced).
        grads: The micro-batch's gradients times `normaliser`, unscaled.
        x: Its inputs (the first one's rows are its rows `n`).
        normaliser: float32 scalar `D`.
        include: Boolean scalar.
        batch: `(sample_weight, mean_reduction)`, refused at trace time
            when they would make the estimate wrong (`noise_scale.check_batch`).
    """
    if not measured(model):
        return
    noise_scale.check_batch(*batch)
    rows = ops.convert_to_tensor(float(first_input(x).shape[0]))
    measures = noise_scale.small_batch_of(grads, rows, normaliser)
    new.noise = new.noise._replace(
        window=new.noise.window + noise_scale.included(measures, include)
    )


def big_squared_norm(model, grads):
    """`|G_big|^2` of the window's gradient (unscaled, unclipped), inside
    the update's branch; zero when not measured (nothing computed)."""
    if not measured(model):
        return ops.zeros((), "float32")
    return noise_scale.squared_norm(grads)


def record_window(model, new, big_sq, done):
    """Where `done` (the window applied): the state after the window
    (`noise_scale.after_window`); a no-op when not measured."""
    if not measured(model):
        return
    new.noise = noise_scale.after_window(new.noise, big_sq, done)


def estimates(model, new):
    """The noise scale's values in `new` (`noise_scale.Estimates`, for
    `keras_fastgrad.step.telemetry.logs`), `None` when not measured."""
    return new.noise if measured(model) else None
