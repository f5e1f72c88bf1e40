"""One micro-batch's order before its update, written once for both steps.

    finite check -> a failure at the scale it was checked at
      -> its drop (or, ungated, its non-finite count) at its own gate,
         where no branch of the step holds it (`drop_place`)
      -> the loss scale's rule (growth per micro-batch only without
         accumulation: `grows_per_micro_batch`)
      -> the update (or the window) where kept (`kept`), the drop
         recorded in the other branch (`drop_place`: `UPDATE`, `WINDOW`)

What each event records is the core's (`dropped`); where it is written is
decided here (`drop_place`, `before_update`); how is the shell's: its
`record_drop(where)` writes `dropped`'s change where `where` holds
(TensorFlow's `apply_if` across replicas, JAX's mask), and the branches
are its `cond`s.
"""

from keras import ops

from keras_fastgrad.step import telemetry as records
from keras_fastgrad.step import verdict as rules

UPDATE = "update"  # the other branch of the update's gate (no accumulation)
WINDOW = "window"  # the other branch of the window's add
OWN = "own"  # its own gate, where the micro-batch is not finite


def kept(finite, gated):
    """What the step keeps of a micro-batch: `finite` (boolean scalar)
    where non-finite micro-batches are dropped (`gated`, Python bool),
    else the Python `True` (applied as `keras.Model` applies it).

    Example:

    >>> kept(False, True), kept(False, False)
    (False, True)
    """
    return finite if gated else True


def grows_per_micro_batch(accumulating):
    """Whether a finite micro-batch counts towards the loss scale's growth
    (Python bool): only without accumulation; a window counts once, when
    its update is applied, as `LossScaleOptimizer` counts its steps. An
    overflow halves the scale either way.

    >>> grows_per_micro_batch(False), grows_per_micro_batch(True)
    (True, False)
    """
    return not accumulating


def drop_place(gated, log_keys, accumulating, window_branch):
    """Where a micro-batch's drop is recorded (gated), or its non-finite
    count (ungated: applied, counted only while a `verdict.COUNT_KEYS` key
    asks, never a failure).

    Args:
        gated: Python bool, non-finite micro-batches are dropped.
        log_keys: Set of the requested telemetry keys.
        accumulating: Python bool.
        window_branch: Python bool, the window's add has a branch that
            runs only where the micro-batch is left out and may write
            there (TensorFlow on one replica).

    Returns:
        `None` (nothing is recorded), `UPDATE` (gated, no accumulation: in
        the other branch of the update's gate), `WINDOW` (gated,
        accumulating, `window_branch`) or `OWN` (at its own gate, where it
        is not finite).

    Example:

    >>> drop_place(True, set(), False, True), drop_place(True, set(), True, True)
    ('update', 'window')
    >>> drop_place(False, set(), False, True), drop_place(False, {"nonfinite_count"}, True, True)
    (None, 'own')
    """
    if not rules.checks(gated, log_keys):
        return None
    if not gated:
        return OWN
    if not accumulating:
        return UPDATE
    return WINDOW if window_branch else OWN


def dropped(log_keys, marks, failed=None, gated=True, with_loss=True):
    """The change of a dropped (ungated: a counted non-finite) micro-batch
    (`telemetry.micro_batch_dropped`): counted, located while a location
    key asks (`telemetry.location`: `marks`, its `maths.finite.marks` or a
    callable giving them, read only then), and a failure where `failed`
    holds (`None`: always; ungated: never). Built in the branch that runs
    only where it is dropped.

    Example:

    >>> change = dropped({"nonfinite_count"}, lambda: 1 / 0, gated=False)
    >>> change.counters.nonfinite_count, change.failed
    (True, False)
    """
    where = records.location(log_keys, marks, with_loss)
    return records.micro_batch_dropped(*where, failed, gated)


def before_update(shell, finite, accumulating, window_branch=False):
    """The micro-batch's records before its update: where its drop goes
    (`drop_place`), written now where that is its own gate (`OWN`:
    `shell.record_drop(where)`, `where` the boolean scalar "not
    `finite`"); a branch of the step writes it at `UPDATE` and `WINDOW`,
    nothing at `None`.

    Args:
        shell: The backend's primitives: `gated` (Python bool),
            `log_keys` (set), `record_drop(where)` (`dropped`'s change
            written where `where` holds).
        finite: Boolean scalar, the micro-batch's verdict.
        accumulating: Python bool.
        window_branch: Python bool, as `drop_place`'s.

    Returns:
        The place (`drop_place`).
    """
    place = drop_place(shell.gated, shell.log_keys, accumulating, window_branch)
    if place == OWN:
        shell.record_drop(ops.logical_not(finite))
    return place
