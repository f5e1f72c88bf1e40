"""`StepState`: everything `FastGradModel`'s step keeps between calls.

One object per model (`model.fastgrad_step_state`), passed explicitly to
the step's units (`keras_fastgrad.backend.tensorflow.train_step`). Unlike optax's
immutable states, the units assign into its variables instead of returning
a new state: Keras' train function runs the step for its side effects and
the variables must exist before the trace. What it holds:

- the units with state (`keras.Variable`s created by `build`, before the
  train function is traced): `telemetry` (`StepTelemetry`), `divergence`
  (`DivergenceWatch`), `accumulator` (`WindowAccumulator`, `None` without
  accumulation), `batchnorm` (`WindowMoments`, `None` unless BatchNorm
  statistics are pooled over micro-batches), `noise_scale`
  (`noise_scale.NoiseScale`, `None` unless a `gns_*` key is requested);
  and those without variables of their own: `scaling`
  (`LossScaling`, around the optimizer), `merger` (`TaskMerger`, `None`
  without `multitask`);
- trace-time facts of the traced step (`facts`, a `TraceFacts`, and
  `trace_count`): Python values recorded while tracing, on purpose;
- where `fit` is (`in_fit`, `evaluating`): Keras calls the same hook at the
  end of an epoch and of an `evaluate`.

The units take the state's parts as arguments; nothing else keeps step
state.

The variables are not layer weights (`model.weights` and `get_weights()`
stay those of a `keras.Model`): the state is an entry of its own in
`.keras` / `.weights.h5` files, so a checkpoint taken mid-window resumes
exactly, a plain `keras.Model` of the same architecture loads a
`FastGradModel`'s file (it has no such entry to read) and a
`FastGradModel` loading a plain model's weights starts its state fresh.
"""

import collections
import contextlib
import weakref

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad.step import noise_scale, state_files
from keras_fastgrad.step.accumulation import WindowAccumulator
from keras_fastgrad.step.batchnorm import WindowMoments, batchnorm_layers, pools_window
from keras_fastgrad.step.divergence import DivergenceWatch
from keras_fastgrad.step.telemetry import LOG_KEYS, StepTelemetry, is_optional_key

# The units with state only some models have, by attribute name: saved
# under keys of their own (`state_files`), in this order.
OPTIONAL = state_files.OPTIONAL


class TraceFacts(
    collections.namedtuple(
        "TraceFacts",
        [
            "tape_variables",
            "no_gradient",
            "grad_is_none",
        ],
    )
):
    """What the latest trace of the step found (Python values, recorded at
    trace time on purpose: they are facts of the graph, not of a step).

    Fields:
        tape_variables: int, how many variables the tape watched.
        no_gradient: list of the paths of variables without a gradient.
        grad_is_none: list of bools, per trainable variable.
    """


def replicas_of(model):
    """How many replicas `model` trains on: its `tf.distribute` strategy's
    (1 without one, as on Keras' JAX backend)."""
    strategy = getattr(model, "distribute_strategy", None)
    return 1 if strategy is None else strategy.num_replicas_in_sync


class StepState(compat.KerasSaveable):
    """The step's state (see the module docstring) and its saved entry.

    Attributes:
        telemetry: `StepTelemetry`, the measured values (variables).
        divergence: `DivergenceWatch`, the failure streak (variables).
        accumulator: `WindowAccumulator`, the window (variables); `None`
            without accumulation.
        batchnorm: `WindowMoments`, the BatchNorm layers' pooled moments
            (variables); `None` unless they are pooled (`batchnorm.pools_window`).
        noise_scale: `noise_scale.NoiseScale` (variables);
            `None` unless a `gns_*` key is requested.
        noise_decay: float, the noise scale's EMA decay.
        scaling: `LossScaling` around the optimizer, set when the train
            function is made.
        options: `StepOptions`, the model's options as the units read
            them (`configure`).
        merger: `TaskMerger`, `None` without `multitask`.
        log_keys: set of the telemetry keys the step returns.
        facts: `TraceFacts` of the latest trace (`None` before one).
        trace_count: int, how many times the step was traced.
        in_fit: bool, inside `fit` (the partial window is applied at the
            epoch's end, not at the end of an `evaluate`).
        evaluating: int, depth of `evaluate` calls in progress.
        flush_function: the traced partial-window flush, or `None`.
        kept_arrays: JAX, in `fit` until its first step is traced: the
            `(variable, array)` pairs Keras' fit detaches (given back if
            tracing raises: `models.model`); `None` otherwise.
    """

    def __init__(self, model, telemetry=StepTelemetry, divergence=DivergenceWatch):
        # The shell's classes of the units that write their own variables
        # (`telemetry`, `divergence`: the core's, or a shell's subclass).
        self._unit_classes = (telemetry, divergence)
        # A weak reference: Keras' saving walks this entry's attributes, and
        # the model would lead it back in a loop.
        self._model_ref = weakref.ref(model)
        self.options = None  # a `StepOptions` (`configure`)
        self.merger = None
        self.log_keys = set()
        # the telemetry keys the traced step logged, and those its train
        # function carries packed (`log_packing`)
        self.telemetry_names = self.packed_names = ()
        self.telemetry = self.divergence = self.accumulator = None
        self.batchnorm = None
        self.noise_scale = None
        self.noise_decay = noise_scale.DEFAULT_DECAY
        self._all_telemetry = False
        self.scaling = None  # set when the train function is made
        self.facts = None
        self.trace_count = 0
        self.in_fit = False
        self.evaluating = 0
        self.flush_function = None
        self.kept_arrays = None
        self._built_for = None
        self._loaded_window_facts = None

    def configure(self, options, merger):
        """The model's options (a `StepOptions`: what the units read of
        them) and the units they choose: the task merger (a
        `keras_fastgrad.multitask.TaskMerger` the model makes: the step
        does not import `multitask`; `None` without `multitask`) and the
        telemetry keys (all with `telemetry`)."""
        self.options = options
        self.merger = merger
        self.log_keys = set(LOG_KEYS) if options.telemetry else set()
        self._all_telemetry = bool(options.telemetry)

    def drops_nonfinite(self):
        """Whether a non-finite micro-batch or update is dropped (a Python
        bool): with `skip_nonfinite`, or under loss scaling (whose own
        rule skips it). Otherwise it is applied, as `keras.Model` does."""
        return bool(self.options.skip_nonfinite or self.scaling.active)

    def set_noise_decay(self, decay):
        """The noise scale's EMA decay (a variable: no retrace)."""
        self.noise_decay = float(decay)
        if self.noise_scale is not None:
            self.noise_scale.set_decay(decay)

    # ------------------------------------------------------------- building
    def build(self, model):
        """Creates the units' variables for `model`'s trainable variables
        (again only when they or the requested optional keys changed; a
        change of keys alone keeps the values)."""
        variables = model.trainable_variables
        if self._all_telemetry and noise_scale.measurable(self.options, replicas_of(model)):
            self.log_keys |= set(noise_scale.KEYS)  # `telemetry=True`: where measurable
        optional = sorted(k for k in self.log_keys if is_optional_key(k))
        layers = batchnorm_layers(model)
        pooled = pools_window(self.options, layers)
        key = (tuple(id(v) for v in variables), tuple(optional), pooled)
        if self._built_for == key:
            return
        old = state_files.held_values(self, self._built_for and self._built_for[0])
        # (Keras' JAX trainer has no `distribute_strategy`: no scope there.)
        strategy = getattr(model, "distribute_strategy", None)
        scope = contextlib.nullcontext() if strategy is None else strategy.scope()
        with scope, keras.name_scope("fastgrad"):
            telemetry_class, divergence_class = self._unit_classes
            telemetry = telemetry_class()
            telemetry.build([v.path for v in variables], optional)
            divergence = divergence_class(self.options.max_consecutive_nonfinite)
            divergence.build()
            accumulator = None
            if self.options.accumulation_steps > 1:
                accumulator = WindowAccumulator(self.options.accumulation_steps)
                accumulator.build(variables)
            batchnorm = None
            if pooled:
                batchnorm = WindowMoments(layers, self.options.micro_batches > 1)
                batchnorm.build()
            noise = None
            if self.log_keys & set(noise_scale.KEYS):
                noise_scale.check_measurable(self.options, replicas_of(model))
                noise = noise_scale.NoiseScale(self.noise_decay)
                noise.build()
        self.telemetry, self.divergence = telemetry, divergence
        self.accumulator, self.batchnorm, self.noise_scale = accumulator, batchnorm, noise
        self._built_for = key
        if old is not None:
            state_files.carry(self, old, key[0])

    @property
    def variables(self):
        """The units' variables (built first if needed): what is saved."""
        if self._built_for is None:
            self.build(self._model_ref())
        state = list(self.telemetry.variables) + self.divergence.variables
        if self.accumulator is not None:
            state += self.accumulator.variables
        # The optional units last, BatchNorm's (fixed by the options) before
        # the noise scale's (there while its keys are requested): a change of
        # keys keeps the values before (`build`). Saved under keys of their
        # own (`OPTIONAL`).
        for _, unit in self.named_units():
            state += unit.variables
        return state

    def values(self):
        """The variables' values (numpy), `[]` before `build`."""
        if self._built_for is None:
            return []
        return [v.numpy() for v in self.variables]

    def streak(self):
        """The divergence streak variable while training (the `loss`
        tracker reads it), `None` while evaluating or before `build`."""
        if self.evaluating or self.divergence is None:
            return None
        return self.divergence.streak

    # --------------------------------------------------- trace-time facts
    def record_trace_facts(self, variables, grads, traced=True):
        """Facts of the traced graph (a Python side effect at trace time,
        on purpose): how many variables the tape watched, which got no
        gradient. `traced`: Python bool, the step is being traced (the
        shell knows: eager steps are not traces)."""
        if traced:
            self.trace_count += 1
        self.facts = TraceFacts(
            tape_variables=len(variables),
            no_gradient=[v.path for v, g in zip(variables, grads) if g is None],
            grad_is_none=[g is None for g in grads],
        )

    @property
    def tape_variables(self):
        """`facts.tape_variables`, `None` before the first trace."""
        return None if self.facts is None else self.facts.tape_variables

    @property
    def no_gradient(self):
        """`facts.no_gradient`, `None` before the first trace."""
        return None if self.facts is None else self.facts.no_gradient

    def no_gradient_template(self):
        """`None` where a variable gets no gradient (the accumulator
        leaves those out of the window's sums), `True` elsewhere; from a
        loaded file's facts before the first trace (`None`: unknown)."""
        grad_is_none = None if self.facts is None else self.facts.grad_is_none
        if grad_is_none is None and self._loaded_window_facts is not None:
            grad_is_none = self._loaded_window_facts[0]
            if self.accumulator is None or len(grad_is_none) != len(self.accumulator.sums):
                grad_is_none = None  # of other variables
        if grad_is_none is None:
            return None
        return [None if none else True for none in grad_is_none]

    def window_facts(self):
        """`(grad_is_none, mean_reduction)`: what the traced step knew of
        the window (saved with it, `state_files`), `None` without
        accumulation or before anything is known."""
        if self.accumulator is None:
            return None
        if self.facts is not None:
            return list(self.facts.grad_is_none), self.accumulator.mean_reduction
        return self._loaded_window_facts

    def record_mean_reduction(self, mean, num_variables):
        """Records (trace time) the window's reduction, `mean` (Python
        bool), for the flush and for a file saved with the window pending
        (`state_files`: a `reduction="sum"` window loaded as a mean one
        would be divided by its micro-batches' count); a step that knows
        no variable without a gradient (`num_variables` of them, each
        given an array) records them all as having one."""
        self.accumulator.mean_reduction = mean
        known = self.window_facts()
        self.set_window_facts(known[0] if known else [False] * num_variables, mean)

    def set_window_facts(self, grad_is_none, mean_reduction):
        """The window's facts from a file (`state_files`): used until a
        trace records its own."""
        self._loaded_window_facts = (list(grad_is_none), bool(mean_reduction))
        if self.accumulator is not None:
            self.accumulator.mean_reduction = bool(mean_reduction)

    # --------------------------------------------------------------- saving
    def _obj_type(self):
        # Keras' saving accepts a few known kinds only; this entry has no
        # saveable attributes of its own to walk.
        return compat.SAVEABLE_OBJ_TYPE

    def save_own_variables(self, store):
        """Keras' hook: the state into a file's entry (`state_files.save`)."""
        model = self._model_ref()
        if model is not None and model.built:
            state_files.save(self, store)

    def load_own_variables(self, store):
        """Keras' hook: the state from a file's entry (`state_files.load`)."""
        self.load({k: store[k] for k in store.keys()})

    def load(self, store):
        """Restores the variables from `{"0": array, "1": ...}`; a mismatch
        (another `accumulation_steps`, other variables) warns and starts
        fresh: the weights are loaded either way."""
        model = self._model_ref()
        if store and model is not None and model.built:
            state_files.load(self, store)

    def load_legacy(self, values):
        """Files written before the state had an entry of its own kept it
        in the model's entry, without the divergence streak (after the
        telemetry)."""
        at = len(self.variables) and len(self.telemetry.variables)
        values = values[:at] + [0.0] + values[at:]
        self.load({str(i): value for i, value in enumerate(values)})

    def named_units(self):
        """`(name, unit)` of the optional units this model has (units
        with state that only some models have: `OPTIONAL`)."""
        units = [(name, getattr(self, name)) for name in OPTIONAL]
        return [(name, unit) for name, unit in units if unit is not None]
