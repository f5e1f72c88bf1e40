"""Gradient telemetry measured inside the compiled step.

Values live in variables so that nothing between two callback calls is lost
when Keras runs several steps per call (`steps_per_execution > 1` returns
only the last step's outputs): counts accumulate, the latest update's norm
and the latest non-finite location are kept until replaced.

Log keys (fixed, all float scalars):

- `grad_norm`: global L2 norm, before clipping, of the gradient of the most
  recent optimizer update (with `clip_adaptive`: after adaptive clipping,
  the norm `clip_norm` compares).
- `clipped_updates`: number of updates whose gradient was clipped.
- `updates`: number of optimizer updates the model made.
- `nonfinite_count`: micro-batches dropped because their loss or gradient
  held NaN/Inf, plus updates dropped because the sum of a window's (or the
  replicas') finite gradients overflowed (cumulative over the model's
  life; saved with the model). With `skip_nonfinite=False` (no loss
  scaling) nothing is dropped: non-finite micro-batches are counted only
  while a `nonfinite_*` key is requested (no check otherwise).
- `nonfinite_first_index`: index into `model.trainable_variables` (as
  watched by the tape) of the first non-finite gradient of the most recent
  dropped micro-batch, -1 if none or if only the loss was non-finite.
- `nonfinite_num_variables`: how many gradients were non-finite in it.
  These two are worked out (in the branch of a dropped micro-batch) only
  while one of them is requested (`NonFiniteGuard`, `telemetry=True`):
  the count and the divergence streak, which safety needs, always are.
- `loss_scale`: the current loss scale (1 without loss scaling).
- `tape_variables`: how many variables the tape watched (a trace-time
  constant; on Keras' JAX backend, which has no tape, the number of
  trainable variables the gradient is taken for).
- `input_shape_changes`: micro-batches whose first input's shape differed
  from the previous micro-batch's (cumulative). Keras 3 `fit` does not
  retrace on a new batch size, but XLA compiles the step for every new
  shape. Counted only while the key is requested (`RetraceWatch`,
  `telemetry=True`).

On request only (they cost extra work in the update branch):

- `grad_norm/<layer>`: per-layer L2 norm of the latest update's gradient
  (before clipping); `<layer>` is the variable path without its last part,
  e.g. `grad_norm/dense_1`. Partial sums of the global norm: nearly free.
- `update_ratio`: `||w_after - w_before|| / ||w_before||` over all trainable
  variables for the latest update (copies the weights before the update).
- `gns_simple`, `gns_grad_sq`, `gns_trace`: the gradient noise scale
  `B_simple` and the EMAs of its numerator and denominator
  (`keras_fastgrad.step.noise_scale`; with accumulation, `micro_batches` or
  several replicas only; `telemetry=True` includes them there).
- `agc_clipped_fraction`: with `clip_adaptive` (adaptive gradient clipping,
  `keras_fastgrad.step.adaptive_clipping`), the fraction of units (output
  units of the kernels, rows of the embedding tables, whole vectors) whose
  gradient was clipped in the latest update (`telemetry=True` includes
  it on a model with `clip_adaptive`).

Multi-task models (`FastGradModel(multitask=...)`) also log, whenever any
telemetry is on, what the task Gram matrix of the latest micro-batch gives
for free (see `keras_fastgrad.multitask`): `task_grad_norm/<task>`,
`task_cosine/<task_a>/<task_b>` and `task_conflicts`.

How the counters change is written once, here, as pure rules over a
`Counters` record (one value per saved counter): each rule returns the
*change* it makes (`Counters` with `None` for a counter it leaves as it
is; for a count, `True` or a boolean scalar: "one more where it holds";
for a latest value, the new value), and `apply` gives the new values.
Each event of the step (`micro_batch_dropped`, `update_applied`,
`update_dropped`) is a `Change`: the counters' change and the divergence
streak's (`keras_fastgrad.step.divergence`). The JAX shell
(`keras_fastgrad.backend.jax.telemetry`) applies them to the values in
Keras' state tuple (`apply_change`); the TensorFlow shell
(`keras_fastgrad.backend.tensorflow.telemetry`) writes them into the
variables (a count as one `AssignAddVariableOp`) inside the branch that
decided them. `logs` makes the log dict (the noise scale's keys
included) on both, `partial_window_keys` says which keys a flush returns; `location` says where a dropped micro-batch went bad,
`StepTelemetry.measure` what an update's optional keys hold.
"""

from typing import Any, NamedTuple

import keras
from keras import ops

from keras_fastgrad.maths import finite
from keras_fastgrad.maths import telemetry as maths
from keras_fastgrad.step import divergence, noise_scale, verdict

LOG_KEYS = (
    "grad_norm",
    "clipped_updates",
    "updates",
    "nonfinite_count",
    "nonfinite_first_index",
    "nonfinite_num_variables",
    "loss_scale",
    "tape_variables",
    "input_shape_changes",
)
LAYER_NORM_PREFIX = "grad_norm/"
UPDATE_RATIO = "update_ratio"
AGC_CLIPPED_FRACTION = "agc_clipped_fraction"
# The keys of where the latest dropped micro-batch went bad, and with the
# count the keys that make an ungated step count non-finite micro-batches
# (the verdict's own sets, `verdict.WHERE_KEYS` and `verdict.COUNT_KEYS`).
LOCATION_KEYS = tuple(sorted(verdict.WHERE_KEYS))
COUNT_KEYS = ("nonfinite_count",) + LOCATION_KEYS


# A multi-task model's keys (`keras_fastgrad.multitask` records them).
NORM_PREFIX = "task_grad_norm/"
COSINE_PREFIX = "task_cosine/"
CONFLICTS = "task_conflicts"


def is_task_key(key):
    """Whether `key` is a multi-task telemetry log key."""
    return key == CONFLICTS or key.startswith((NORM_PREFIX, COSINE_PREFIX))


def layer_key(variable_path):
    """The per-layer log key of a variable path: `grad_norm/<layer>`."""
    return LAYER_NORM_PREFIX + variable_path.rsplit("/", 1)[0]


def is_optional_key(key):
    return (
        key in (UPDATE_RATIO, AGC_CLIPPED_FRACTION)
        or key.startswith(LAYER_NORM_PREFIX)
        or is_task_key(key)  # multi-task models only (keras_fastgrad.multitask)
        or noise_scale.is_key(key)  # needs two batch sizes (`noise_scale`)
    )


def counts_nonfinite(drops, keys):
    """Whether the step checks and counts non-finite micro-batches: the
    verdict's rule (`verdict.checks`), read by the telemetry.

    >>> counts_nonfinite(False, {"updates"}), counts_nonfinite(False, {"nonfinite_count"})
    (False, True)
    """
    return verdict.checks(drops, keys)


def locates_nonfinite(keys):
    """Whether a dropped micro-batch's location (`LOCATION_KEYS`) is worked
    out: only while one of those keys is requested (`keys`)."""
    return bool(set(keys) & set(LOCATION_KEYS))


def location(keys, marks, with_loss=True):
    """Where a dropped micro-batch went bad, `(first_bad, num_bad)`
    (`finite.summarize`), worked out only while a `LOCATION_KEYS` key is
    requested; `(None, None)` otherwise (`dropped` then leaves the latest
    location as it was).

    Args:
        keys: The requested keys (a set).
        marks: The micro-batch's `maths.finite.marks` vector, or a callable
            returning it (called only while a key asks); `None` (no
            gradient, no loss: nothing to point at) gives `(-1, 0)`.
        with_loss: Python bool, whether the vector's last entry is the
            loss's.

    Example:

    >>> first, num = location({"nonfinite_first_index"}, keras.ops.array([1.0, float("nan")]), False)
    >>> int(first), int(num)
    (1, 1)
    >>> location({"updates"}, lambda: 1 / 0)
    (None, None)
    """
    if not locates_nonfinite(keys):
        return None, None
    marks = marks() if callable(marks) else marks
    if marks is None:
        return -1.0, 0.0
    return finite.summarize(marks, with_loss=with_loss)


class Counters(NamedTuple):
    """The step's saved counters, one float32 scalar each (values, or the
    variables holding them), in the order the files keep them.

    Fields:
        grad_norm: The latest update's gradient norm (latest value).
        clipped_updates: Updates whose gradient was clipped (count).
        updates: Optimizer updates made (count).
        nonfinite_count: Micro-batches and updates dropped (count).
        nonfinite_first_index: Where the latest dropped micro-batch went
            bad (latest value, -1: nowhere known).
        nonfinite_num_variables: How many of its gradients were
            non-finite (latest value).
        input_shape_changes: Micro-batches whose first input's shape
            differed from the previous one's (count).
        last_input_batch: The previous micro-batch's rows (latest value,
            -1: none yet).
        last_input_size: Its first input's element count (latest value).
    """

    grad_norm: Any = None
    clipped_updates: Any = None
    updates: Any = None
    nonfinite_count: Any = None
    nonfinite_first_index: Any = None
    nonfinite_num_variables: Any = None
    input_shape_changes: Any = None
    last_input_batch: Any = None
    last_input_size: Any = None


# The fields that count (a change adds one where it holds); the others
# hold the latest value (a change replaces it).
COUNTS = frozenset({"clipped_updates", "updates", "nonfinite_count", "input_shape_changes"})
# The initial values (a fresh model, a state started anew).
INITIAL = Counters(0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, -1.0, -1.0)


def dropped(first_bad=None, num_bad=None):
    """The change of a dropped micro-batch: counted, and where it went bad
    (index of its first non-finite gradient, -1 when only its loss was;
    how many were) when the shell worked it out (`None`: not asked).

    Example:

    >>> dropped(3, 1)
    Counters(grad_norm=None, clipped_updates=None, updates=None, nonfinite_count=True, nonfinite_first_index=3, nonfinite_num_variables=1, input_shape_changes=None, last_input_batch=None, last_input_size=None)
    """
    return Counters(
        nonfinite_count=True, nonfinite_first_index=first_bad, nonfinite_num_variables=num_bad
    )


def dropped_update():
    """The change of a window (or replica sum) of finite gradients that
    overflowed and was dropped at its update: counted as non-finite, no
    variable to point at (-1)."""
    return Counters(nonfinite_count=True, nonfinite_first_index=-1.0)


def updated(norm=None, was_clipped=None):
    """The change of an applied update: counted; its gradient's norm
    (`None`: not measured) and whether it was clipped (boolean scalar,
    `None`: no clipping)."""
    return Counters(updates=True, grad_norm=norm, clipped_updates=was_clipped)


def input_shape(last_batch, last_size, rows, size):
    """The change of a micro-batch of `rows` rows whose first input holds
    `size` elements: counted when either differs from the previous
    micro-batch's (`last_batch`, `last_size`; `last_batch < 0`: none
    before), and remembered.

    Example:

    >>> change = input_shape(8.0, 32.0, 4.0, 16.0)
    >>> bool(change.input_shape_changes), change.last_input_batch
    (True, 4.0)
    """
    changed = ops.logical_and(
        ops.greater_equal(last_batch, 0.0),
        ops.logical_or(ops.not_equal(rows, last_batch), ops.not_equal(size, last_size)),
    )
    return Counters(input_shape_changes=changed, last_input_batch=rows, last_input_size=size)


def apply(counters, change, where=True):
    """The counters after `change`, made where `where` holds.

    Args:
        counters: `Counters` of float32 values.
        change: `Counters` a rule returned (`None`: unchanged).
        where: Boolean scalar or `True`: whether the change happened.

    Returns:
        `Counters` of float32 values.

    Example:

    >>> c = apply(INITIAL, dropped(2, 1))
    >>> float(c.nonfinite_count), float(c.nonfinite_first_index)
    (1.0, 2.0)
    >>> c = apply(c, updated(norm=5.0), where=False)
    >>> float(c.updates), float(c.grad_norm)
    (0.0, 0.0)
    """
    new = []
    for name, old, value in zip(Counters._fields, counters, change, strict=True):
        if value is None:
            new.append(old)
        elif name in COUNTS:
            holds = value if where is True else (where if value is True else where & value)
            new.append(old + (1.0 if holds is True else ops.cast(holds, "float32")))
        else:
            value = ops.cast(value, "float32")
            new.append(value if where is True else ops.where(where, value, old))
    return Counters(*new)


class Change(NamedTuple):
    """What one event of the step changes in its counted state: a record
    of deltas and new values, which each shell applies where its state
    lives (`apply_change` on values; the TensorFlow shell's variables by
    `assign_add` / `assign`).

    Fields:
        counters: `Counters` of the counters' changes (see `apply`).
        failed: The divergence streak's change: one more failure where it
            holds (`True`, or a boolean scalar within the event's `where`);
            `False`: none (`divergence.streak_after`).
        applied: The streak back to 0 where it holds (`True`: an applied
            update); `None`: not reset.
    """

    counters: Counters = Counters()
    failed: Any = False
    applied: Any = None


def micro_batch_dropped(first_bad=None, num_bad=None, failed=None, gated=True):
    """A dropped (or, ungated, a non-finite) micro-batch: counted, located
    (`location`; `None`: left as it was) and, where the step drops
    (`gated`, a Python bool), a failure where `failed` holds (`None`:
    always; a boolean scalar: `divergence.counts_as_failure`'s).
    `skip_nonfinite=False` applies the micro-batch (`gated=False`): it is
    counted while a `COUNT_KEYS` key asks, and is no failure.

    Example:

    >>> micro_batch_dropped(gated=False).failed, micro_batch_dropped().failed
    (False, True)
    """
    if not gated:
        failed = False
    elif failed is None:
        failed = True
    return Change(dropped(first_bad, num_bad), failed)


def update_applied(norm=None, was_clipped=None):
    """An applied update (`updated`): counted, its norm and clipping
    recorded, the streak reset."""
    return Change(updated(norm, was_clipped), applied=True)


def update_dropped():
    """A finite micro-batch's (or window's) update that overflowed, or
    that AGC's check refused (`dropped_update`): counted, and a failure."""
    return Change(dropped_update(), failed=True)


def counted_once(change):
    """`(counters_only, streak_only)`: `change` in two parts, for an event
    whose counters change only where it was not counted already (an
    update refused by AGC after its micro-batches' verdict counted them:
    `adaptive_clipping.counted_at_verdict`) while the streak changes
    anyway."""
    return change._replace(failed=False, applied=None), change._replace(counters=Counters())


def apply_change(counters, streak, change, where=True):
    """`(counters, streak)` after `change`, made where `where` holds.

    Args:
        counters: `Counters` of float32 values.
        streak: float32 scalar, the divergence streak.
        change: A `Change`.
        where: Boolean scalar or `True`: whether the event happened.

    Example:

    >>> c, streak = apply_change(INITIAL, 2.0, update_dropped())
    >>> float(c.nonfinite_count), float(streak)
    (1.0, 3.0)
    >>> c, streak = apply_change(c, streak, update_applied(), where=keras.ops.array(True))
    >>> float(c.updates), float(streak)
    (1.0, 0.0)
    """

    def at(value):  # `True`: where the event happened; else the caller's, within it
        return where if value is True else value

    counters = apply(counters, change.counters, where)
    applied = None if change.applied is None else at(change.applied)
    return counters, divergence.streak_after(streak, failed=at(change.failed), applied=applied)


def measures_after(old, measured, entered, applied):
    """The optional keys' values after an update's branch: `update_ratio`
    where the update was `applied`, the gradient's keys (`grad_norm/<layer>`,
    `agc_clipped_fraction`) where its branch was `entered` (a finite
    micro-batch, any with `skip_nonfinite=False`, a complete window).

    Args:
        old: Dict `{key: float32 scalar}` of the values before.
        measured: Dict `{key: float32 scalar}` measured in the branch.
        entered: Boolean scalar (or `True`).
        applied: Boolean scalar (or `True`).

    Returns:
        Dict `{key: float32 scalar}` of `measured`'s keys.

    Example:

    >>> out = measures_after({"update_ratio": 0.5, "grad_norm/d": 1.0},
    ...                      {"update_ratio": 0.1, "grad_norm/d": 3.0},
    ...                      entered=True, applied=False)
    >>> {k: float(v) for k, v in out.items()}
    {'update_ratio': 0.5, 'grad_norm/d': 3.0}
    """
    return {
        key: ops.where(applied if key == UPDATE_RATIO else entered, value, old[key])
        for key, value in measured.items()
    }


def logs(counters, loss_scale, tape_variables, keys=None, optional=(), read=None, noise=None):
    """The step's telemetry log dict, float32 scalars: the fixed keys
    (`LOG_KEYS` order), then the optional keys', then the noise scale's
    (`noise_scale.logs`).

    Args:
        counters: `Counters` of values or of the variables holding them.
        loss_scale: float32 scalar, the current loss scale.
        tape_variables: Python int, how many variables the gradient is
            taken for.
        keys: Optional set of the keys wanted (`None`: every key); only
            those are read.
        optional: `(key, value or variable)` pairs of the optional keys.
        read: How the shell reads one of them (default: a float32 cast).
        noise: Optional `noise_scale.Estimates` (values or the variables);
            its moving averages are read only while a `gns_*` key is
            wanted.

    Example:

    >>> out = logs(INITIAL, 1.0, 4, keys={"updates", "tape_variables"})
    >>> {k: float(v) for k, v in out.items()}
    {'updates': 0.0, 'tape_variables': 4.0}
    """
    read = read or (lambda value: ops.cast(value, "float32"))

    def wanted(key):
        return keys is None or key in keys

    out = {}
    for key in LOG_KEYS:
        if not wanted(key):
            continue
        if key == "loss_scale":
            out[key] = ops.cast(loss_scale, "float32")
        elif key == "tape_variables":
            out[key] = ops.convert_to_tensor(float(tape_variables), "float32")
        else:
            out[key] = read(getattr(counters, key))
    out.update({key: read(value) for key, value in optional if wanted(key)})
    if noise is not None and any(wanted(key) for key in noise_scale.KEYS):
        emas = (noise.ema_grad_sq, noise.ema_trace, noise.ema_weight)
        out.update(noise_scale.logs(*(read(v) for v in emas), keys=keys))
    return out


def partial_window_keys(state):
    """The keys a partial window's flush returns
    (`FastGradModel.apply_partial_window`), the same on every backend, in
    the logs' order (`logs`): every fixed key (`LOG_KEYS`, requested or
    not), the optional keys the step measures for the model (its requested
    `grad_norm/<layer>`, `update_ratio`, `agc_clipped_fraction`:
    `StepTelemetry.measured_keys`) and the noise scale's keys where it is
    measured. Not the multi-task keys: they describe a micro-batch, and a
    flush has none. `fit` takes from them the keys its epoch logs hold.

    Args:
        state: The model's `StepState` (its `telemetry` built, `options`,
            `noise_scale`).

    Example:

    >>> from types import SimpleNamespace
    >>> telemetry = StepTelemetry()
    >>> telemetry.build(["d/kernel"], ["update_ratio"])
    >>> state = SimpleNamespace(
    ...     telemetry=telemetry, options=SimpleNamespace(clip_adaptive=None), noise_scale=None
    ... )
    >>> partial_window_keys(state)[len(LOG_KEYS):]
    ('update_ratio',)
    """
    measured = state.telemetry.measured_keys(state.options.clip_adaptive)
    return LOG_KEYS + tuple(measured) + (() if state.noise_scale is None else noise_scale.KEYS)


class StepTelemetry:
    """The step's measurements, kept in float32 scalar variables (on every
    backend; the shells change them by the rules above).

    Example:

    >>> t = StepTelemetry()
    >>> t.build(["dense/kernel", "dense/bias"], ["grad_norm/dense"])
    >>> [k for k, _ in t.optional_variables()]
    ['grad_norm/dense']
    >>> float(t.counters().nonfinite_first_index.numpy())
    -1.0
    """

    def build(self, variable_paths=(), optional_keys=()):
        """Creates the state variables.

        Args:
            variable_paths: Paths of the watched variables, in order.
            optional_keys: Requested optional keys (`grad_norm/<layer>`,
                `update_ratio`, `agc_clipped_fraction`); their variables
                are measurements, not training state, and are not saved
                with the model.
        """
        self.layer_of_variable = [layer_key(p) for p in variable_paths]
        self.layer_norms = {
            key: _variable(0.0, key.replace("/", "_"))
            for key in dict.fromkeys(self.layer_of_variable)
            if key in optional_keys
        }
        self.update_ratio = _variable(0.0, UPDATE_RATIO) if UPDATE_RATIO in optional_keys else None
        self.agc_clipped_fraction = (
            _variable(0.0, AGC_CLIPPED_FRACTION) if AGC_CLIPPED_FRACTION in optional_keys else None
        )
        for name, value in zip(Counters._fields, INITIAL, strict=True):
            setattr(self, name, _variable(value, name))

    def counters(self):
        """`Counters` of the variables."""
        return Counters(*(getattr(self, name) for name in Counters._fields))

    @property
    def variables(self):
        """The saved variables (`Counters`' order)."""
        return list(self.counters())

    def optional_variables(self):
        """`[(key, variable)]` of the optional keys there are variables
        for, in the logs' order."""
        pairs = list(self.layer_norms.items())
        for key in (UPDATE_RATIO, AGC_CLIPPED_FRACTION):
            variable = getattr(self, key)
            if variable is not None:
                pairs.append((key, variable))
        return pairs

    def measured_keys(self, clip_adaptive):
        """The optional keys an update measures, in the logs' order
        (`agc_clipped_fraction` only with `clip_adaptive`, the option:
        `None` is off)."""
        keys = [key for key, _ in self.optional_variables()]
        return [k for k in keys if clip_adaptive is not None or k != AGC_CLIPPED_FRACTION]

    def measure(self, grads=None, before=None, after=None, agc_fraction=None, total=None):
        """The optional keys' values for one update, `{key: float32
        scalar}`, of the keys requested (variables built) that the
        arguments give: `grad_norm/<layer>` of `grads` (the update's
        gradient after adaptive clipping, before `clip_norm`, dense: a
        sparse one's rows summed by the caller), `update_ratio` of the
        weights `before` and `after` it (`total`: as in
        `maths.telemetry.update_ratio`), `agc_clipped_fraction`
        (`agc_fraction`, float32 scalar). Where the shell keeps them:
        `measures_after`.

        Example:

        >>> t = StepTelemetry()
        >>> t.build(["d/kernel", "d/bias"], ["grad_norm/d", "update_ratio"])
        >>> out = t.measure([keras.ops.array([3.0]), keras.ops.array([4.0])])
        >>> {k: float(v) for k, v in out.items()}
        {'grad_norm/d': 5.0}
        """
        out = {}
        if grads is not None and self.layer_norms:
            out.update(maths.layer_norms(grads, self.layer_of_variable, self.layer_norms))
        if before is not None and self.update_ratio is not None:
            out[UPDATE_RATIO] = maths.update_ratio(before, after, total=total)
        if agc_fraction is not None and self.agc_clipped_fraction is not None:
            out[AGC_CLIPPED_FRACTION] = agc_fraction
        return out

    def record_adaptive_clipping(self, fraction):
        """The fraction of units adaptive clipping clipped (update branch)."""
        if self.agc_clipped_fraction is not None:
            self.agc_clipped_fraction.assign(fraction)


def _variable(value, name):
    """A float32 counter that is the same on every replica (replica 0's
    write is kept), never autocast, never trained (as
    `keras_fastgrad.step.variables.global_variable`)."""
    return keras.Variable(
        value,
        dtype="float32",
        trainable=False,
        autocast=False,
        aggregation="only_first_replica",
        name=name,
    )
