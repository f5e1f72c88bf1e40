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
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.maths import telemetry as maths
from keras_fastgrad.step import noise_scale
from keras_fastgrad.step.gradients import summed_rows
from keras_fastgrad.step.variables import global_variable

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


class StepTelemetry:
    """The step's measurements, kept in float32 scalar variables.

    Example:

    >>> t = StepTelemetry()
    >>> t.build()
    >>> t.record_drop(tf.constant(3), tf.constant(1))
    >>> float(t.nonfinite_count.numpy()), float(t.nonfinite_first_index.numpy())
    (1.0, 3.0)
    """

    def build(self, variable_paths=(), optional_keys=()):
        """Creates the state variables.

        Args:
            variable_paths: Paths of the watched variables, in order.
            optional_keys: Requested optional keys (`grad_norm/<layer>`,
                `update_ratio`, `agc_clipped_fraction`); their variables are measurements, not
                training state, and are not saved with the model.
        """
        self.layer_of_variable = [layer_key(p) for p in variable_paths]
        self.layer_norms = {
            key: global_variable(0.0, key.replace("/", "_"))
            for key in dict.fromkeys(self.layer_of_variable)
            if key in optional_keys
        }
        self.update_ratio = (
            global_variable(0.0, UPDATE_RATIO) if UPDATE_RATIO in optional_keys else None
        )
        self.agc_clipped_fraction = (
            global_variable(0.0, AGC_CLIPPED_FRACTION)
            if AGC_CLIPPED_FRACTION in optional_keys
            else None
        )
        self.grad_norm = global_variable(0.0, "grad_norm")
        self.clipped_updates = global_variable(0.0, "clipped_updates")
        self.updates = global_variable(0.0, "updates")
        self.nonfinite_count = global_variable(0.0, "nonfinite_count")
        self.nonfinite_first_index = global_variable(-1.0, "nonfinite_first_index")
        self.nonfinite_num_variables = global_variable(0.0, "nonfinite_num_variables")
        self.input_shape_changes = global_variable(0.0, "input_shape_changes")
        self.last_input_batch = global_variable(-1.0, "last_input_batch")
        self.last_input_size = global_variable(-1.0, "last_input_size")

    @property
    def variables(self):
        return [
            self.grad_norm,
            self.clipped_updates,
            self.updates,
            self.nonfinite_count,
            self.nonfinite_first_index,
            self.nonfinite_num_variables,
            self.input_shape_changes,
            self.last_input_batch,
            self.last_input_size,
        ]

    def record_drop(self, first_bad=None, num_bad=None):
        """Counts a dropped micro-batch and, when given, remembers where it
        went bad (runs only in the branch of a non-finite micro-batch)."""
        increment(self.nonfinite_count, 1.0)
        if first_bad is not None:
            self.nonfinite_first_index.assign(tf.cast(first_bad, tf.float32))
            self.nonfinite_num_variables.assign(tf.cast(num_bad, tf.float32))

    def record_dropped_update(self):
        """A window (or replica sum) of finite micro-batch gradients that
        overflowed was dropped at its update: counted as non-finite."""
        increment(self.nonfinite_count, 1.0)
        self.nonfinite_first_index.assign(-1.0)

    def record_layer_norms(self, grads):
        """Per-layer norms of the update's gradient (before clipping;
        `keras_fastgrad.maths.telemetry`, as on JAX)."""
        if not self.layer_norms:
            return
        grads = [None if g is None else summed_rows(g) for g in grads]
        norms = maths.layer_norms(grads, self.layer_of_variable, self.layer_norms)
        for layer, variable in self.layer_norms.items():
            variable.assign(norms[layer])

    def record_adaptive_clipping(self, fraction):
        """The fraction of units adaptive clipping clipped (update branch)."""
        if self.agc_clipped_fraction is not None:
            self.agc_clipped_fraction.assign(fraction)

    def record_update_ratio(self, before, variables):
        """`||w_after - w_before|| / ||w_before||` (inside the branch; as
        `maths.telemetry.update_ratio`, in TensorFlow ops: `AddN`s, 16 ops
        fewer on the benchmark MLP than the `keras.ops` sums)."""
        if self.update_ratio is None:
            return
        delta = tf.add_n(
            [
                tf.reduce_sum(tf.square(tf.cast(v.value, tf.float32) - b))
                for v, b in zip(variables, before)
            ]
        )
        size = tf.add_n([tf.reduce_sum(tf.square(b)) for b in before])
        self.update_ratio.assign(tf.sqrt(delta) / tf.maximum(tf.sqrt(size), 1e-12))

    def snapshot(self, variables):
        """float32 copies of the weights before an update, if needed."""
        if self.update_ratio is None:
            return None
        return [tf.identity(tf.cast(v.value, tf.float32)) for v in variables]

    def record_input_shape(self, first_input):
        """Counts micro-batches whose input shape differs from the previous
        one's (batch size or element count of the first input): under XLA
        every new shape is a compile."""
        batch = tf.cast(tf.shape(first_input)[0], tf.float32)
        size = tf.cast(tf.size(first_input), tf.float32)
        changed = tf.logical_and(
            self.last_input_batch >= 0.0,
            tf.logical_or(
                tf.not_equal(batch, self.last_input_batch),
                tf.not_equal(size, self.last_input_size),
            ),
        )
        increment(self.input_shape_changes, tf.where(changed, 1.0, 0.0))
        self.last_input_batch.assign(batch)
        self.last_input_size.assign(size)

    def record_update(self, norm, was_clipped):
        """Records one optimizer update (inside the update branch)."""
        increment(self.updates, 1.0)
        if norm is not None:
            self.grad_norm.assign(norm)
        if was_clipped is not None:
            increment(self.clipped_updates, tf.cast(was_clipped, tf.float32))

    def logs(self, loss_scale, tape_variables, keys=None):
        """The log dict returned by the step.

        Args:
            loss_scale: float32 scalar, the current loss scale.
            tape_variables: Python int, the watched variables' number.
            keys: Optional set of keys: only those are read (one
                `ReadVariableOp` each); `None`: every key.
        """

        def wanted(key):
            return keys is None or key in keys

        logs = {v.name: _read(v) for v in self.variables if v.name in LOG_KEYS and wanted(v.name)}
        logs["loss_scale"] = loss_scale
        logs["tape_variables"] = tf.constant(float(tape_variables))
        logs = {key: logs[key] for key in LOG_KEYS if key in logs and wanted(key)}
        logs.update({k: _read(v) for k, v in self.layer_norms.items() if wanted(k)})
        if self.update_ratio is not None and wanted(UPDATE_RATIO):
            logs[UPDATE_RATIO] = _read(self.update_ratio)
        if self.agc_clipped_fraction is not None and wanted(AGC_CLIPPED_FRACTION):
            logs[AGC_CLIPPED_FRACTION] = _read(self.agc_clipped_fraction)
        return logs


def _read(variable):
    """The variable's value now, as a tensor (one read, no copy)."""
    return tf.convert_to_tensor(variable.value)
