"""`profile_step`: where a train step's time goes, and how fast it runs
eager, under `tf.function`, under XLA and in mixed precision.

Each phase is its own function on the same batch: forward (call + loss),
forward + backward (the gradients), and the model's real `train_step`. The
backward time is (forward + backward) - forward; the update time is
step - (forward + backward). Every (mode, phase) function is warmed up
(tracing and XLA compilation are not timed), then all are run
interleaved, one call each per round, and the median of the rounds is
reported: a slow moment of a shared machine hits every column alike.
"""

import dataclasses
import importlib

from keras_fastgrad import _compat as compat
from keras_fastgrad.models.model import FastGradModel
from keras_fastgrad.profiling import _report
from keras_fastgrad.profiling import _runs as runs
from keras_fastgrad.profiling._runs import MODES, PHASES

# Per backend shell (`keras_fastgrad.backend.shell().NAME`): the module
# that makes each mode's calls, and the mode that runs the compiled step
# (whose traces `profile_step` counts).
_RUNS = {
    "tensorflow": ("keras_fastgrad.profiling._runs", "function"),
    "jax": ("keras_fastgrad.profiling._jax_runs", "xla"),
}


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Median milliseconds of the three phases of one mode."""

    forward_ms: float
    forward_backward_ms: float
    step_ms: float

    @property
    def backward_ms(self):
        return self.forward_backward_ms - self.forward_ms

    @property
    def update_ms(self):
        """Step minus forward + backward: the optimizer update and whatever
        else the step does (metrics, telemetry, multi-task merging, the
        slice loop of `micro_batches`; forward and backward run on the
        whole batch)."""
        return self.step_ms - self.forward_backward_ms

    @property
    def backward_forward_ratio(self):
        return self.backward_ms / self.forward_ms


@dataclasses.dataclass
class StepProfile(_report.ReportMixin):
    """What `profile_step` measured (times in milliseconds, medians).

    Attributes:
        model_name, model_class: the profiled model.
        batch_size: samples in the profiled batch.
        repeats, warmup: timed rounds and untimed warm-up calls per function.
        phases: dict mode -> `PhaseTimes`, for the modes that ran.
        skipped: dict mode -> why that mode could not run.
        traces: times the compiled step (`tf.function`; on JAX `jax.jit`)
            was traced while profiling on one fixed batch; more than 1
            means retracing.
        tape_variables: variables the train step's gradient tape watched
            (`FastGradModel.tape_variable_count`; for other models, those a
            default `tf.GradientTape` watches, as Keras' own step does); on
            JAX, which has no tape, the variables the gradient is taken for.
        trainable_variables: `len(model.trainable_variables)`.
        data_ms: median time to get one batch from the dataset (`None`
            when `data` was not a `tf.data.Dataset`).
        data_shapes: distinct batch shapes met while timing the dataset.
        model_mode: the mode the model trains in (`"eager"` if
            `run_eagerly`, `"xla"` if `jit_compile=True`, else
            `"function"`).

    Example:

    >>> inputs = keras.Input((8,))
    >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> # The compiled step: `tf.function` on TensorFlow, `jax.jit` on JAX.
    >>> compiled = "xla" if keras.backend.backend() == "jax" else "function"
    >>> profile = keras_fastgrad.profile_step(
    ...     model, (np.ones((16, 8)), np.ones((16, 1))), modes=(compiled,),
    ...     repeats=2, warmup=1, verbose=0)
    >>> list(profile.phases) == [compiled], profile.tape_variables, profile.trainable_variables
    (True, 2, 2)
    """

    model_name: str
    model_class: str
    batch_size: int
    repeats: int
    warmup: int
    phases: dict
    skipped: dict
    traces: int
    tape_variables: object
    trainable_variables: int
    data_ms: object = None
    data_shapes: object = None
    model_mode: str = "function"

    def speedup(self, mode, baseline="eager"):
        """Step time of `baseline` / step time of `mode` (`None` if either
        did not run)."""
        if mode not in self.phases or baseline not in self.phases:
            return None
        return self.phases[baseline].step_ms / self.phases[mode].step_ms


def profile_step(model, data, modes=MODES, repeats=20, warmup=3, batch_size=None, verbose=1):
    """Profiles one train step of a compiled model.

    Times forward, forward + backward and the full train step (the model's
    own `train_step`) on the same batch, in each of `modes`:

    - `"eager"`: plain Python calls, no graph;
    - `"function"`: `tf.function`, as `fit` runs the step by default;
    - `"xla"`: `tf.function(jit_compile=True)`;
    - `"mixed_float16"`: `tf.function` on a clone of the model built under
      the `mixed_float16` dtype policy (every float32 layer policy becomes
      `mixed_float16`; same weights; compiled like the model, so the
      optimizer gets a `LossScaleOptimizer`). The global policy is
      restored afterwards.
    - `"mixed_bfloat16"`: the same with `mixed_bfloat16` (no loss scaling;
      the half type that CPUs with bfloat16 units run fast).

    On Keras' JAX backend the phases run on the state values Keras threads
    through its step: `"eager"` calls them as they are, `"xla"` under
    `jax.jit` (as `fit` runs the step), the mixed modes under `jax.jit` on
    the clone; `"function"` has no JAX counterpart and is reported in
    `skipped`. A mode that cannot run (XLA cannot compile an op, the model cannot be
    cloned) is reported in `skipped` with the reason. The model's weights,
    optimizer state, metrics and step state are snapshotted and restored:
    after profiling they are as before (the model and its optimizer are
    built first if needed, as `fit` would). Times are medians over
    `repeats` interleaved rounds after `warmup` untimed calls of every
    function. With `accumulation_steps=k` only every k-th step applies an
    update, so the median step is a step that only accumulates.

    Args:
        model: A compiled `keras.Model` (functional, sequential or
            subclassed; `FastGradModel` or not), on one device.
        data: One batch: a tuple `(x, y)` or `(x, y, sample_weight)` of
            arrays or tensors (or `x` alone for a model without targets),
            or a `tf.data.Dataset` of such batches: its first batch is
            profiled and the time to get a batch from it is measured too.
        modes: Sequence of names from `keras_fastgrad.profiling.measure.MODES`,
            defaults to all five.
        repeats: Integer >= 1, defaults to `20`. Timed rounds.
        warmup: Integer >= 1, defaults to `3`. Untimed calls of each
            function first (the first one traces and compiles).
        batch_size: Integer >= 1 or `None` (default). With array data,
            profile only the first `batch_size` samples; `None` takes the
            arrays whole as one batch. Not allowed with a dataset.
        verbose: `0` or `1` (default): print the table and recommendations.

    Returns:
        A `StepProfile`: `.phases`, `.speedup(mode, baseline)`,
        `.recommendations()`, `.table()`, `.save_png(path)`.

    Raises:
        TypeError, ValueError: for invalid arguments, an uncompiled model,
            an empty dataset or a model under a multi-device strategy.

    Example:

    >>> inputs = keras.Input((4,))
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((8, 4)), np.zeros((8, 1))
    >>> compiled = "xla" if keras.backend.backend() == "jax" else "function"
    >>> profile = keras_fastgrad.profile_step(
    ...     model, (x, y), modes=("eager", compiled), repeats=2, warmup=1,
    ...     verbose=0)
    >>> list(profile.phases) == ["eager", compiled], profile.traces, profile.tape_variables
    (True, 1, 2)
    >>> print(profile.table())  # doctest: +ELLIPSIS
    Step profile of Functional 'functional...' (batch 8; ...
    """
    from keras_fastgrad import backend

    shell = backend.shell()
    runs_module, compiled_mode = _RUNS[shell.NAME]
    mode_calls = importlib.import_module(runs_module).mode_calls
    modes, repeats, warmup, batch_size, verbose = _report.check_arguments(
        model, modes, repeats, warmup, batch_size, verbose, data
    )
    data_ms = data_shapes = None
    if runs.is_dataset(data):
        batch, data_ms, data_shapes = runs.time_dataset(data, repeats, warmup)
    else:
        batch = data
    batch = runs.as_tensors(batch, batch_size)
    compat.symbolic_build(model, batch)  # builds model, loss, metrics, optimizer
    saved_train_function = model.train_function
    model.make_train_function()  # FastGradModel sets its step state up here
    state = runs.Snapshot(model)
    facts = {}
    calls, skipped = {}, {}
    try:
        for mode in modes:
            try:
                calls.update(mode_calls(model, mode, batch, facts))
            except Exception as e:  # noqa: BLE001 - reported, not raised
                skipped[mode] = runs.reason(e)
        calls, more_skipped = runs.warm_up(calls, warmup)
        skipped.update(more_skipped)
        state.restore()
        medians = runs.interleaved_medians(calls, repeats)
        traces = None
        if "step_function" in facts and compiled_mode not in skipped:
            traces = shell.trace_count(facts["step_function"])
    finally:
        state.restore()
        model.train_function = saved_train_function
    phases = {
        mode: PhaseTimes(*(medians[(mode, phase)] for phase in PHASES))
        for mode in modes
        if mode not in skipped
    }
    # A tape watches what the step reads (`FastGradModel` counts it); JAX
    # differentiates every trainable variable (`facts`, as for any model).
    tape_variables = (
        model.tape_variable_count
        if isinstance(model, FastGradModel) and shell.TAPE
        else facts.get("watched")
    )
    profile = StepProfile(
        model_name=model.name,
        model_class=type(model).__name__,
        batch_size=runs.batch_size_of(batch),
        repeats=repeats,
        warmup=warmup,
        phases=phases,
        skipped=skipped,
        traces=traces,
        tape_variables=tape_variables,
        trainable_variables=len(model.trainable_variables),
        data_ms=data_ms,
        data_shapes=data_shapes,
        model_mode=runs.model_mode(model),
    )
    if verbose:
        print(profile)
    return profile
