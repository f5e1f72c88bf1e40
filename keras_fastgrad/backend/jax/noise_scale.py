"""The gradient noise scale in the JAX step (`GradientNoiseScale`, the
`gns_*` telemetry keys), on values.

The same estimate as on TensorFlow (`keras_fastgrad.step.noise_scale`; the
maths, once for both: `keras_fastgrad.maths.noise_scale`): each
micro-batch of an accumulation window is a small batch (its gradient times
its loss normaliser `D_i`, unscaled, as the window adds it up; a
non-finite one is left out), the window's gradient at its update
(unscaled, unclipped) the big one, and the moving averages of `|G|^2` and
`tr(Sigma)` move once per applied window. The state is `NoiseScale`'s
variables (the window's five sums, the three EMAs, the decay), threaded
through Keras' state tuple with the step's others (`add_slots`): each
function here returns nothing and writes new values into the step's
`new` dict, which the step writes back.

On JAX the small batches are the accumulation window's micro-batches
only: under `micro_batches` a micro-batch's slices are not measured apart
(its whole batch is the small batch), and under
`keras.distribution.DataParallel` neither are the devices' shards (the
arrays are global). Without accumulation nothing is measurable
(`noise_scale.measurable`).
"""

from keras import ops

from keras_fastgrad.maths import noise_scale as maths
from keras_fastgrad.step import noise_scale
from keras_fastgrad.step.splitting import first_input

# The noise scale's slots in the step's `new` dict, as `NoiseScale` orders
# its variables.
_SLOTS = ("gns_window", "gns_ema_grad_sq", "gns_ema_trace", "gns_ema_weight", "gns_decay")


def measured(model):
    """Whether the step measures the noise scale (a `gns_*` key asked)."""
    return model.fastgrad_step_state.noise_scale is not None


def add_slots(model, slots):
    """Adds the noise scale's variables' positions to `slots.ntv` (the
    step then reads them into `new` and writes them back); a no-op when
    not measured."""
    if not measured(model):
        return
    where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    variables = model.fastgrad_step_state.noise_scale.variables
    for key, variable in zip(_SLOTS, variables, strict=True):
        slots.ntv[key] = where[id(variable)]


def squared_norm(grads):
    """float32 scalar: `|grads|^2` (no overflow rescue: a square beyond
    float32 is `inf`, and the window's estimate, not finite, is skipped)."""
    total = ops.zeros((), "float32")
    for g in grads:
        total = total + ops.sum(ops.square(g))
    return total


def record_small(model, new, grads, x, normaliser, include, batch):
    """Adds the micro-batch (one small batch) to the window, unless not
    `include` (a non-finite micro-batch); a no-op when not measured.

    Args:
        model: The `FastGradModel`.
        new: The step's dict of new values.
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
    measures = maths.small_batch(squared_norm(grads), rows, normaliser)
    window = new["gns_window"]
    new["gns_window"] = window + ops.where(include, measures, ops.zeros_like(measures))


def big_squared_norm(model, grads):
    """`|G_big|^2` of the window's gradient (unscaled, unclipped), inside
    the update's branch; zero when not measured (nothing computed)."""
    if not measured(model):
        return ops.zeros((), "float32")
    return squared_norm(grads)


def record_window(model, new, big_sq, done):
    """Where `done` (the window applied): its estimates into the moving
    averages (`maths.window_estimate`, `maths.moving_averages`), and the
    window restarts; a no-op when not measured."""
    if not measured(model):
        return
    window = new["gns_window"]
    grad_sq, trace, valid = maths.window_estimate(window, big_sq)
    emas = tuple(new[k] for k in _SLOTS[1:4])
    emas = maths.moving_averages(emas, new["gns_decay"], grad_sq, trace, valid & done)
    for key, value in zip(_SLOTS[1:4], emas):
        new[key] = value
    new["gns_window"] = ops.where(done, ops.zeros_like(window), window)


def logs(model, new, keys):
    """The requested `gns_*` keys' values (float32 scalars)."""
    wanted = [k for k in noise_scale.KEYS if k in keys]
    if not wanted or not measured(model):
        return {}
    simple, grad_sq, trace = maths.logs(*(new[k] for k in _SLOTS[1:4]))
    values = {noise_scale.SIMPLE: simple, noise_scale.GRAD_SQ: grad_sq, noise_scale.TRACE: trace}
    return {k: values[k] for k in wanted}


def host_logs(model):
    """The `gns_*` keys now, as Python floats (after a flush: the partial
    window's estimate), `{}` when not measured."""
    if not measured(model):
        return {}
    noise = model.fastgrad_step_state.noise_scale
    emas = (noise.ema_grad_sq, noise.ema_trace, noise.ema_weight)
    values = maths.logs(*(ops.convert_to_tensor(v.value) for v in emas))
    return {k: float(v) for k, v in zip(noise_scale.KEYS, values)}
