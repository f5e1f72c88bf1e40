"""`profile_step`'s phase functions on Keras' JAX backend.

The same three phases on the same batch as on TensorFlow (`_runs`), on the
state values that Keras' JAX trainer threads through its step (`(trainable,
non_trainable, optimizer, metrics)`, read once from the model): forward
(Keras' `compute_loss_and_updates`, the loss as the step scales it),
forward + backward (`jax.value_and_grad` of it over the trainable values)
and the model's own `train_step(state, data)` (`FastGradModel`'s JAX step,
or Keras' own). Each call waits for its outputs (`jax.block_until_ready`:
JAX dispatches asynchronously). Nothing is written back to the model (the
step is stateless), so the model is as before whatever runs.

Modes: `"eager"` (the functions called as they are), `"xla"` (`jax.jit`,
as `fit` runs the step with `jit_compile=True`, Keras' JAX default) and the
mixed-precision modes (`jax.jit` on the clone `_runs.mixed_precision_clone`
makes). `"function"` (TensorFlow's graph without XLA) has no JAX
counterpart: it is reported in `skipped`, with that reason.
"""

import jax
import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad.profiling import _runs as runs

NO_FUNCTION_MODE = (
    "no JAX counterpart: `tf.function` without XLA is TensorFlow's; on JAX a "
    "compiled step is `jax.jit` (the 'xla' mode)"
)


def state_of(model):
    """The values Keras' JAX trainer hands the train step."""
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )


def phase_functions(model, facts):
    """forward, forward_backward and step as functions of the state and a batch."""

    def loss_of(trainable, state, data):
        _, non_trainable, optimizer_variables, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, _ = model.compute_loss_and_updates(
            trainable,
            non_trainable,
            metrics,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_variables,
        )
        return loss

    def forward(state, data):
        return loss_of(state[0], state, data)

    def forward_backward(state, data):
        facts["watched"] = len(state[0])  # every trainable value, at trace time
        return jax.grad(loss_of)(state[0], state, data)

    def step(state, data):
        return model.train_step(state, data)

    return {"forward": forward, "forward_backward": forward_backward, "step": step}


def mode_calls(model, mode, batch, facts):
    """{(mode, phase): (callable of the batch, batch)} for one mode."""
    if mode == "function":
        raise NotImplementedError(NO_FUNCTION_MODE)
    if mode in runs.MIXED_MODES:
        model = runs.mixed_precision_clone(model, mode)
        compat.symbolic_build(model, batch)
        model.make_train_function()
        facts = {}
    state = state_of(model)
    calls = {}
    for phase, fn in phase_functions(model, facts).items():
        if mode != "eager":
            fn = jax.jit(fn)
            if mode == "xla" and phase == "step":
                facts["step_function"] = fn

        def call(data, fn=fn):
            return jax.block_until_ready(fn(state, data))

        calls[(mode, phase)] = (call, batch)
    return calls


def traces(function):
    """How many times the jitted step was compiled (its cache's size), or
    `None` where JAX does not say."""
    return compat.jit_cache_size(function)
