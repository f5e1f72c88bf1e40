"""The measuring side of `profile_step`: the phase functions of each mode,
the mixed-precision clone, the interleaved timing, and the snapshot that
puts the model's state back."""

import statistics
import sys
import time

import keras
import numpy as np
from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.forward import call_for_training, watching
from keras_fastgrad.models.model import FastGradModel
from keras_fastgrad.step.slicing import first_input

MODES = ("eager", "function", "xla", "mixed_float16", "mixed_bfloat16")
PHASES = ("forward", "forward_backward", "step")
MIXED_MODES = ("mixed_float16", "mixed_bfloat16")


# ------------------------------------------------------------------ phases
def phase_functions(model, facts):
    """forward, forward_backward and step as Python functions of a batch."""
    fastgrad = isinstance(model, FastGradModel)
    compute_loss = compat.compute_loss_function(model)

    def loss_of(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = call_for_training(model, x)
        loss = compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        return model.optimizer.scale_loss(loss)

    def forward(data):
        return loss_of(data)

    def forward_backward(data):
        variables = model.trainable_variables
        # The same tape as the model's own step: FastGradModel watches
        # exactly its trainable variables, Keras' step watches all it uses.
        with watching(variables) if fastgrad else tf.GradientTape() as tape:
            loss = loss_of(data)
        facts["watched"] = len(tape.watched_variables())  # at trace time
        grads = tape.gradient(loss, [v.value for v in variables])
        return [g for g in grads if g is not None]  # outputs keep them alive

    def step(data):
        return model.distribute_strategy.run(model.train_step, args=(data,))

    return {"forward": forward, "forward_backward": forward_backward, "step": step}


def mode_calls(model, mode, batch, facts):
    """{(mode, phase): (callable, batch)} for one mode."""
    if mode in MIXED_MODES:
        model = mixed_precision_clone(model, mode)
        compat.symbolic_build(model, batch)
        model.make_train_function()
        facts = {}
    functions = phase_functions(model, facts)
    calls = {}
    for phase, fn in functions.items():
        if mode != "eager":
            fn = tf.function(fn, jit_compile=mode == "xla", reduce_retracing=True)
            if mode == "function" and phase == "step":
                facts["step_function"] = fn
        calls[(mode, phase)] = (fn, batch)
    return calls


def mixed_precision_clone(model, policy):
    """The model rebuilt under `policy`, compiled alike, with the same weights."""
    config = _to_policy(keras.saving.serialize_keras_object(model), policy)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        clone = keras.saving.deserialize_keras_object(
            config, custom_objects={type(model).__name__: type(model)}
        )
    finally:
        keras.mixed_precision.set_global_policy(previous)
    if not clone.compiled:
        clone.compile_from_config(model.get_compile_config())
    clone.set_weights(model.get_weights())
    return clone


def _to_policy(config, policy):
    """The config with every float32 layer dtype policy replaced by `policy`
    (a functional model's layers carry their policy in their config)."""
    if isinstance(config, dict):
        if (
            config.get("class_name") == "DTypePolicy"
            and config.get("config", {}).get("name") == "float32"
        ):
            return {**config, "config": {**config["config"], "name": policy}}
        return {k: _to_policy(v, policy) for k, v in config.items()}
    if isinstance(config, list):
        return [_to_policy(v, policy) for v in config]
    return config


def is_dataset(data):
    """Whether `data` is a `tf.data.Dataset` (TensorFlow is not imported to
    tell: without it, nothing is one)."""
    return "tensorflow" in sys.modules and isinstance(data, tf.data.Dataset)


# ------------------------------------------------------------------ timing
def _synchronizer():
    """Waits for the devices' queued work: accelerator kernels run
    asynchronously. On a CPU-only machine calls return finished work. (On
    JAX each call waits for its own outputs: `_jax_runs`.)"""
    if keras.backend.backend() == "jax":
        return lambda: None
    if any(d.device_type != "CPU" for d in tf.config.list_logical_devices()):
        return tf.test.experimental.sync_devices
    return lambda: None


def warm_up(calls, warmup):
    """Runs every call `warmup` times; a mode with a failing call is dropped."""
    skipped, sync = {}, _synchronizer()
    for (mode, phase), (fn, batch) in calls.items():
        if mode in skipped:
            continue
        try:
            for _ in range(warmup):
                fn(batch)
            sync()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            skipped[mode] = f"{phase}: {reason(e)}"
    return {k: v for k, v in calls.items() if k[0] not in skipped}, skipped


def interleaved_medians(calls, repeats):
    """Medians of `repeats` rounds; a round calls every function once.

    The first call after switching to another mode's functions runs on
    cold caches; rotating the modes and, within a mode, the phases from
    round to round makes each phase come first in only a third of the
    rounds, so the median is free of that cost.
    """
    modes = list(dict.fromkeys(mode for mode, _ in calls))
    times, sync = {key: [] for key in calls}, _synchronizer()
    for r in range(repeats if modes else 0):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            shift = r % len(PHASES)
            for phase in PHASES[shift:] + PHASES[:shift]:
                fn, batch = calls[(mode, phase)]
                start = time.perf_counter()
                fn(batch)
                sync()
                times[(mode, phase)].append(1000.0 * (time.perf_counter() - start))
    return {key: statistics.median(values) for key, values in times.items()}


def time_dataset(dataset, repeats, warmup):
    """The first batch, the median ms per batch, the distinct batch shapes."""
    iterator = iter(dataset.repeat())
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(
            "`data` is an empty `tf.data.Dataset`: there is no batch to "
            "profile. Received: data with 0 elements."
        ) from None
    for _ in range(warmup - 1):
        next(iterator)
    times, shapes = [], set()
    for _ in range(repeats):
        start = time.perf_counter()
        batch = next(iterator)
        times.append(1000.0 * (time.perf_counter() - start))
        shapes.add(tuple(tuple(t.shape) for t in tree.flatten(batch)))
    return first, statistics.median(times), len(shapes)


# ------------------------------------------------------------------ helpers
class Snapshot:
    """Values of every variable a step can change, to put back later."""

    def __init__(self, model):
        variables = (
            list(model.variables) + list(model.optimizer.variables) + list(model.metrics_variables)
        )
        if isinstance(model, FastGradModel):
            variables += model.fastgrad_step_state.variables
        unique = {id(v): v for v in variables}
        self.variables = list(unique.values())
        self.values = [np.array(v.numpy()) for v in self.variables]

    def restore(self):
        for v, value in zip(self.variables, self.values):
            v.assign(value)


def as_tensors(batch, batch_size):
    def convert(value):
        if value is None:
            return None
        if batch_size is not None:
            value = value[:batch_size]
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
            value = value.astype(keras.backend.floatx())
        if keras.backend.backend() == "jax":  # (a `tf.data` batch too)
            return keras.ops.convert_to_tensor(np.asarray(value))
        return tf.convert_to_tensor(value)

    if isinstance(batch, list):
        batch = tuple(batch)
    return tree.map_structure(convert, batch)


def batch_size_of(batch):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return int(first_input(x).shape[0])


def model_mode(model):
    if model.run_eagerly:
        return "eager"
    return "xla" if model.jit_compile is True else "function"


def reason(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
