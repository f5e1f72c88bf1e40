"""The step's state on the model: created before tracing, saved with it.

`FastGradModel` keeps its accumulators and telemetry counters in
`keras.Variable`s held by small units (`WindowAccumulator`,
`StepTelemetry`), not as layer weights: `model.weights` and
`get_weights()` stay those of a `keras.Model`. The state is saved in an
entry of its own of a `.keras` / `.weights.h5` file (`StepStateEntry`), so
a checkpoint taken mid-window resumes exactly, weights saved by a plain
`keras.Model` load into a `FastGradModel`, and weights saved by a
`FastGradModel` load into a plain `keras.Model` of the same architecture. Trace-time facts (how many variables the tape watched, which got
no gradient) are recorded here too.
"""

import warnings
import weakref

import keras
import tensorflow as tf

from keras_fastgrad import _keras_compat as compat
from keras_fastgrad.accumulation import WindowAccumulator
from keras_fastgrad.divergence import DivergenceWatch
from keras_fastgrad.telemetry import LOG_KEYS, StepTelemetry, is_optional_key, layer_key

_STATE_PREFIX = "fastgrad_"


class StepStateEntry(compat.KerasSaveable):
    """The step's state as an entry of its own in `.keras` and
    `.weights.h5` files (`fastgrad_step_state`), next to the model's
    weights rather than among them: a plain `keras.Model` of the same
    architecture loads the file (it has no such entry to read), and a
    `FastGradModel` loading weights saved by a plain `keras.Model` finds no
    entry and starts its state fresh.
    """

    def __init__(self, model):
        # A weak reference, not the model: Keras' saving walks this entry's
        # attributes, and a model attribute would lead it back in a loop.
        self._model_ref = weakref.ref(model)

    def _obj_type(self):
        # Keras' saving accepts a few known kinds only; this entry has no
        # saveable attributes of its own to walk.
        return compat.SAVEABLE_OBJ_TYPE

    def save_own_variables(self, store):
        model = self._model_ref()
        if model is not None and model.built:
            for i, v in enumerate(model._fg_state_variables()):
                store[str(i)] = v.numpy()

    def load_own_variables(self, store):
        model = self._model_ref()
        if model is not None:
            model._fg_load_state({k: store[k] for k in store.keys()})


class StepStateMixin:
    """State, saving and trace-time facts of `FastGradModel`'s step."""

    def _fg_build_state(self):
        """Creates the step's state for the current trainable variables."""
        variables = self.trainable_variables
        optional = sorted(k for k in self._fg_log_keys if is_optional_key(k))
        key = (tuple(id(v) for v in variables), tuple(optional))
        if self._fg_state_for == key:
            return
        old_state = self._fg_state_values()
        with self.distribute_strategy.scope(), keras.name_scope("fastgrad"):
            telemetry = StepTelemetry()
            telemetry.build([v.path for v in variables], optional)
            divergence = DivergenceWatch(self.max_consecutive_nonfinite)
            divergence.build()
            accumulator = None
            if self.accumulation_steps > 1:
                accumulator = WindowAccumulator(self.accumulation_steps)
                accumulator.build(variables)
        same_variables = self._fg_state_for and self._fg_state_for[0] == key[0]
        self._fg_telemetry, self._fg_accumulator = telemetry, accumulator
        self._fg_divergence = divergence
        self._fg_state_for = key
        if same_variables:  # only the requested keys changed: keep the state
            for v, value in zip(self._fg_state_variables(), old_state):
                v.assign(value)

    def _fg_state_values(self):
        if self._fg_state_for is None:
            return []
        return [v.numpy() for v in self._fg_state_variables()]

    def _fg_state_variables(self):
        """The step's training state: saved and restored with the model."""
        if self._fg_state_for is None:
            self._fg_build_state()
        state = list(self._fg_telemetry.variables) + self._fg_divergence.variables
        if self._fg_accumulator is not None:
            state += self._fg_accumulator.variables
        return state

    def load_own_variables(self, store):
        # Files written before the state had an entry of its own kept it in
        # the model's entry, as `fastgrad_<i>`: still read.
        keys = list(store.keys())
        own = {k: store[k] for k in keys if not k.startswith(_STATE_PREFIX)}
        super().load_own_variables(own)
        legacy = [store[f"{_STATE_PREFIX}{i}"] for i in range(len(keys)) if f"{_STATE_PREFIX}{i}" in store]
        if legacy and self.built:
            # That layout had no divergence streak after the telemetry.
            at = len(self._fg_state_variables()) and len(self._fg_telemetry.variables)
            legacy = legacy[:at] + [0.0] + legacy[at:]
            self._fg_load_state({str(i): value for i, value in enumerate(legacy)})

    def _fg_load_state(self, store):
        """Restores the step's state from `{"0": array, "1": ...}`; a
        mismatch (another `accumulation_steps`, other variables) warns and
        starts fresh: the weights are loaded either way."""
        if not store or not self.built:
            return
        state = self._fg_state_variables()
        if len(store) != len(state):
            warnings.warn(
                f"FastGradModel: the saved step state has {len(store)} "
                f"variables but this model's has {len(state)} (different "
                "`accumulation_steps` or trainable variables?). The "
                "accumulation window and counters start fresh; the weights "
                "were loaded."
            )
            return
        for i, v in enumerate(state):
            v.assign(store[str(i)])

    def _fg_record_trace_facts(self, variables, grads):
        # Python side effect at trace time on purpose: these are facts of
        # the traced graph (how many variables the tape watched, which got
        # no gradient), not per-step values.
        if not tf.executing_eagerly():  # eager steps are not traces
            self._fg_trace_count += 1
        self._fg_tape_variables = len(variables)
        self._fg_no_gradient = [
            v.path for v, g in zip(variables, grads) if g is None
        ]
        self._fg_grad_is_none = [g is None for g in grads]

    def _fg_no_gradient_template(self):
        flags = getattr(self, "_fg_grad_is_none", None)
        if flags is None:
            return None
        return [None if none else True for none in flags]

    @property
    def tape_variable_count(self):
        """Number of variables the tape watched in the traced train step
        (`None` before the first trace)."""
        return self._fg_tape_variables

    @property
    def train_step_trace_count(self):
        """How many times `train_step` was traced (retracing shows here)."""
        return self._fg_trace_count

    def layer_norm_keys(self):
        """The `grad_norm/<layer>` keys this model's layers would log."""
        return list(dict.fromkeys(layer_key(v.path) for v in self.trainable_variables))

    @property
    def variables_without_gradient(self):
        """Paths of trainable variables that got no gradient in the traced
        step (unused, or cut off by `stop_gradient`); `None` before the
        first trace."""
        return self._fg_no_gradient

    def enable_telemetry(self, keys=LOG_KEYS):
        """Adds telemetry keys to the step's logs (used by the callbacks).

        Args:
            keys: Iterable of names from `keras_fastgrad.LOG_KEYS`.

        Raises:
            ValueError: for a name that is not a telemetry key.

        The train function is rebuilt (retraced) on the next `fit` when the
        set of keys grows.
        """
        keys = set(keys)
        unknown = {k for k in keys if k not in LOG_KEYS and not is_optional_key(k)}
        if unknown:
            raise ValueError(
                f"`keys` must be names from {list(LOG_KEYS)}, "
                "`update_ratio` or `grad_norm/<layer>` (multi-task models: "
                "`task_grad_norm/<task>`, `task_cosine/<a>/<b>`, "
                f"`task_conflicts`). Received unknown names: {sorted(unknown)}"
            )
        if not keys <= self._fg_log_keys:
            self._fg_log_keys |= keys
            self.train_function = None

    def telemetry_counters(self):
        """The step's cumulative counters now, as Python floats.

        Returns:
            Dict with `updates`, `clipped_updates` and `nonfinite_count`
            (over the model's life; saved with the model). Zeros before the
            step's state exists. Reads three scalars from the device.

        Example:

        >>> inputs = keras.Input((2,))
        >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.telemetry_counters()
        {'updates': 0.0, 'clipped_updates': 0.0, 'nonfinite_count': 0.0}
        """
        names = ("updates", "clipped_updates", "nonfinite_count")
        if self._fg_telemetry is None:
            return dict.fromkeys(names, 0.0)
        return {name: float(getattr(self._fg_telemetry, name).numpy()) for name in names}

