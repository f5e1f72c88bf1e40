"""Exact gradient accumulation over a window of micro-batches: the rules,
written once for both backends' steps (no backend imported).

Keras reduces a loss as `S / D` (`keras_fastgrad.step.weighting`: `D` is the
number of loss elements, of valid ones under a mask, or the sum of sample
weights), so the gradient of the concatenated window is

    g = sum_j (D_j / N) g_j,    N = sum_j D_j,

(`g = sum_j g_j` for `reduction="sum"`). The window keeps `sum_j D_j g_j`,
`N`, the micro-step count and the number of included micro-batches
(`WindowState`, float32 sums; model state, saved with the model) and its
update divides once (`window_gradient`). The rules:

- a micro-batch left out (non-finite) adds neither to the sums nor to `N`,
  nor to the included count; it counts as a micro-step (`added`, `kept`,
  `counted`);
- a window is complete on every `steps`-th micro-step (`is_complete`,
  `is_last` before the count), and applied only if it holds an included
  micro-batch (`applies`); one whose `N` is 0 (every sample weight 0, every
  position masked) still makes an update, with a zero gradient, as Keras
  does on the big batch (its loss is `divide_no_nan(S, D)`);
- after its update the window empties (`emptied`; the micro-step runs on);
  a partial window (`apply_partial_window`, an epoch's end) is applied if
  it holds samples, then restarts at micro-step 0 (`restarted`), and
  `pending` says how many micro-batches it holds.

How the state is threaded is the backend's (`backend/tensorflow/accumulation`:
variables, a `tf.cond`, sparse rows; `backend/jax/window`: values in Keras'
state tuple); where a rule needs a primitive whose form differs (a
selection, a division), the shell passes its own in.
"""

from typing import Any, NamedTuple

import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.variables import global_variable, sharded_as


class WindowState(NamedTuple):
    """The window: variables (TensorFlow) or values (JAX), field for field.

    Attributes:
        sums: List, per trainable variable, of `sum_j D_j g_j` (float32;
            `None` where a variable gets no gradient).
        normaliser: float32 scalar, `N = sum_j D_j` over included ones.
        micro_step: Integer scalar, micro-batches counted (it runs on
            across windows; `restarted` sets it to 0).
        included: Integer scalar, included micro-batches of this window.
    """

    sums: Any
    normaliser: Any
    micro_step: Any
    included: Any


class MicroBatch(NamedTuple):
    """What one micro-batch brings to its window.

    Attributes:
        grads: List of gradients already multiplied by the micro-batch's
            `D_j` (`None` where a variable has none).
        normaliser: float32 scalar, `D_j` (summed over replicas).
        keep: Boolean scalar, whether it is included; the Python `True`:
            nothing is ever left out (known when traced).
        mean: Python bool, whether the window's gradient is its sums over
            `N` (`False`: a `"sum"` loss, the sums themselves).
    """

    grads: Any
    normaliser: Any
    keep: Any = True
    mean: bool = True


class WindowAccumulator:
    """The window's state variables and its trace-time facts.

    Args:
        steps: Integer >= 2, micro-batches per optimizer update.

    Example:

    >>> acc = WindowAccumulator(steps=2)
    >>> acc.build([keras.Variable([0.0, 0.0])])
    >>> [tuple(v.shape) for v in acc.variables]
    [(2,), (), (), ()]
    >>> bool(acc.has_samples())
    False
    """

    def __init__(self, steps):
        self.steps = steps
        self.sums = []
        self.normaliser = self.micro_step = self.included = None
        # Trace-time fact of the loss (its reduction), recorded by the step
        # and read by the flush: the same for the model's life.
        self.mean_reduction = True

    def build(self, variables):
        """Creates the float32 state for the given trainable variables."""
        self.sums = [
            compat.variable(
                keras.ops.zeros(v.shape, "float32"),
                trainable=False,
                autocast=False,
                synchronization="on_read",  # per replica, summed when read
                aggregation="sum",
                name=f"accumulated_{i}",
                **sharded_as(v),  # (each device sums its own shard)
            )
            for i, v in enumerate(variables)
        ]
        # Global values, the same on every replica.
        self.normaliser = global_variable(0.0, "accumulated_normaliser")
        # int64 on TensorFlow; int32 on JAX, whose 64-bit types are off by
        # default (an int64 variable is stored as int32 there, and every
        # stateless call warned so). A file converts either way on loading.
        counter = "int32" if keras.backend.backend() == "jax" else "int64"
        self.micro_step = global_variable(0, "micro_step", dtype=counter)
        self.included = global_variable(0, "included_micro_batches", dtype=counter)

    @property
    def variables(self):
        """The state, in the order it is saved (`included` last: files
        saved before it existed lack only that one, `included_of_old_file`)."""
        return self.sums + [self.normaliser, self.micro_step, self.included]

    def state(self):
        """The variables as a `WindowState`."""
        return WindowState(self.sums, self.normaliser, self.micro_step, self.included)

    def has_samples(self):
        """Boolean scalar: the window holds an included micro-batch."""
        return has_samples(self.included)


# ------------------------------------------------------------------ rules
def kept(keep, value, where):
    """What a micro-batch adds of `value` (its weighted gradient or `D_j`):
    `value` when kept, 0 when left out.

    Args:
        keep: Boolean scalar, or the Python `True` (`value` itself).
        value: A tensor.
        where: The backend's `where(condition, x, y)`.

    >>> kept(True, 3.0, None)
    3.0
    >>> float(kept(keras.ops.array(False), keras.ops.array(3.0), keras.ops.where))
    0.0
    """
    if keep is True:
        return value
    return where(keep, value, 0.0)


def counted(keep, cast):
    """What a micro-batch adds to the included count: 1 when kept, 0 when
    left out (`cast(keep)`: the boolean as the count's dtype).

    >>> counted(True, None)
    1
    """
    if keep is True:
        return 1
    return cast(keep)


def added(window, micro_batch, where=None):
    """The window with `micro_batch` added, on values: its weighted
    gradients to the sums and its `D_j` to the normaliser when kept, the
    included count, and one micro-step either way.

    Args:
        window: `WindowState` of values.
        micro_batch: `MicroBatch` (its gradients dense; `None` where the
            window's sum is `None`).
        where: The backend's `where(condition, x, y)`.

    Returns:
        `WindowState`.

    Example:

    >>> window = WindowState([keras.ops.zeros(2)], 0.0, 0, 0)
    >>> batch = MicroBatch([keras.ops.array([4.0, 2.0])], 2.0)
    >>> window = added(window, batch)
    >>> keras.ops.convert_to_numpy(window.sums[0]).tolist(), window[1:]
    ([4.0, 2.0], (2.0, 1, 1))
    """
    where = ops.where if where is None else where
    keep = micro_batch.keep
    dtype = getattr(window.included, "dtype", "int32")
    return WindowState(
        [
            s if g is None else s + kept(keep, g, where)
            for s, g in zip(window.sums, micro_batch.grads)
        ],
        window.normaliser + kept(keep, micro_batch.normaliser, where),
        window.micro_step + 1,
        window.included + counted(keep, lambda k: ops.cast(k, dtype)),
    )


def is_complete(micro_step, steps):
    """Whether the micro-step just counted closes its window.

    >>> [bool(is_complete(m, 3)) for m in (1, 2, 3, 6)]
    [False, False, True, True]
    """
    return micro_step % steps == 0


def is_last(micro_step, steps):
    """Whether the micro-batch about to be counted (`micro_step` not yet
    incremented) closes its window.

    >>> [bool(is_last(m, 3)) for m in (0, 1, 2, 5)]
    [False, False, True, True]
    """
    return (micro_step + 1) % steps == 0


def closes(window, steps, every_kept):
    """`(complete, applied)` of the window a micro-batch was just added to
    (`window.micro_step` counting it): whether it is complete
    (`is_complete`), and whether it is applied (`applies`).

    Args:
        window: `WindowState` (values, or variables).
        steps: Python int, the window's micro-batches.
        every_kept: Python bool, no micro-batch is ever left out.

    >>> [bool(b) for b in closes(WindowState([], 2.0, 4, 0), 2, every_kept=False)]
    [True, False]
    """
    complete = is_complete(window.micro_step, steps)
    return complete, applies(complete, window.included, every_kept)


def has_samples(included):
    """Whether the window holds an included micro-batch (its normaliser may
    be 0: then its update's gradient is 0, as Keras' on the big batch).

    >>> bool(has_samples(0)), bool(has_samples(2))
    (False, True)
    """
    return included > 0


def applies(complete, included, every_kept):
    """Whether the window is applied: complete and holding an included
    micro-batch (a window of only left-out ones is not applied).

    Args:
        complete: Boolean scalar (`is_complete`).
        included: The included count, this micro-batch counted.
        every_kept: Python bool, no micro-batch is ever left out: the
            window is then applied once complete (nothing to read).
    """
    if every_kept:
        return complete
    return complete & has_samples(included)


def window_gradient(sums, normaliser, mean, divide_no_nan=None):
    """The window's gradient: `sum_j D_j g_j / sum_j D_j`, or the sums
    themselves when not `mean` (a `"sum"` loss). A normaliser of 0 gives 0,
    as Keras' `divide_no_nan` reduction does on the big batch.

    Args:
        sums: List of the window's sums (`None` kept).
        normaliser: float32 scalar, `N`.
        mean: Python bool.
        divide_no_nan: The backend's `divide_no_nan(x, y)`.

    Example:

    >>> grads = window_gradient([keras.ops.array([4.0, 8.0]), None], 4.0, True)
    >>> keras.ops.convert_to_numpy(grads[0]).tolist(), grads[1]
    ([1.0, 2.0], None)
    >>> keras.ops.convert_to_numpy(window_gradient([keras.ops.ones(1)], 0.0, True)[0])
    array([0.], dtype=float32)
    """
    if not mean:
        return sums
    inverse = (divide_no_nan or ops.divide_no_nan)(1.0, normaliser)
    return [None if g is None else g * inverse for g in sums]


def emptied(window, zeros):
    """The window after its update (or an empty start): sums, normaliser
    and included count emptied; the micro-step runs on, so that the next
    window closes `steps` micro-steps after the last.

    Args:
        window: `WindowState`.
        zeros: Callable, a field's value (or variable) -> its emptied value.

    >>> emptied(WindowState([5.0], 2.0, 3, 1), lambda v: 0)
    WindowState(sums=[0], normaliser=0, micro_step=3, included=0)
    """
    return window._replace(
        sums=[None if s is None else zeros(s) for s in window.sums],
        normaliser=zeros(window.normaliser),
        included=zeros(window.included),
    )


def restarted(window, zeros):
    """The window after a partial window's flush: emptied, and the next one
    starting at micro-step 0 (`emptied`'s `zeros`).

    >>> restarted(WindowState([5.0], 2.0, 3, 1), lambda v: 0)
    WindowState(sums=[0], normaliser=0, micro_step=0, included=0)
    """
    return emptied(window, zeros)._replace(micro_step=zeros(window.micro_step))


def flushed(window, apply_where, zeros):
    """A partial window's flush (`apply_partial_window`, an epoch's end):
    its update where it holds samples (`has_samples`), then the window
    restarted (`restarted`).

    Args:
        window: `WindowState` (values, or variables).
        apply_where: Callable taking a boolean scalar, the backend's
            update of the window where it holds (a `cond`).
        zeros: As for `emptied`.

    Returns:
        `WindowState`: the restarted window.

    >>> applied = []
    >>> flushed(WindowState([5.0], 2.0, 3, 1), applied.append, lambda v: 0)
    WindowState(sums=[0], normaliser=0, micro_step=0, included=0)
    >>> bool(applied[0])
    True
    """
    apply_where(has_samples(window.included))
    return restarted(window, zeros)


def pending(micro_step, steps):
    """The micro-batches counted in the open window (0 once it was applied).

    >>> pending(5, 2), pending(4, 2)
    (1, 0)
    """
    return int(micro_step) % steps


def included_of_old_file(normaliser):
    """The included count of a window saved before it was kept (files of
    earlier releases): a window with a positive normaliser held at least
    one included micro-batch (all that was decided by then).

    >>> included_of_old_file(3.0), included_of_old_file(0.0)
    (1, 0)
    """
    return int(float(normaliser) > 0.0)
