"""The verdict on a micro-batch and on its update: the rules, written once.

Backend-neutral (`keras.ops` on boolean scalars, and Python facts known
when the step is traced); both shells call these functions:
TensorFlow's `keras_fastgrad.backend.tensorflow.verdict` (a `Verdict` per
micro-batch, then `tf.cond`) and JAX's `keras_fastgrad.backend.jax.step`
(values, then `lax.cond`).

The rules:
- what is checked: every micro-batch while non-finite ones are dropped
  (`skip_nonfinite`, or loss scaling) or a `nonfinite_*` key reads the
  count (`checks`); otherwise nothing, as `keras.Model` (`Verdict.keep` is
  then the Python `True`: applied, non-finite values included);
- how: one element sum per gradient, or the gradient's global norm where
  the update needs that norm anyway (`checks_norm`: the norm is finite
  exactly when every element is);
- what is kept: a finite micro-batch whose update may be applied (a
  clip factor that is a normal float, AGC's unit norms finite: `keep`);
- what counts towards the divergence streak (`keep`, with
  `divergence.counts_as_failure`);
- whether the update needs a check of its own before it is applied
  (`update_check`: a window's or the replicas' sum of finite gradients can
  overflow; a clip factor must be a normal float).
"""

from typing import Any, NamedTuple

from keras import ops

# The telemetry keys that say where a dropped micro-batch went bad.
WHERE_KEYS = frozenset({"nonfinite_first_index", "nonfinite_num_variables"})
# The keys that read the count of non-finite micro-batches.
COUNT_KEYS = WHERE_KEYS | {"nonfinite_count"}


class Verdict(NamedTuple):
    """The finite check of one micro-batch, global over replicas.

    Fields:
        marks: The `maths.finite.marks` vector (where the check failed),
            or `None` when the check was the gradient's norm (`norm`).
        all_finite: Boolean scalar: loss and gradients finite everywhere;
            the Python `True` when nothing asked (`checks` is false: not
            checked).
        keep: Boolean scalar: the gradient goes on; the Python `True` when
            non-finite gradients are applied, as `keras.Model` does (no
            `cond` on it: nothing waits for it).
        drops_nonfinite: Python bool: a non-finite micro-batch is dropped
            (`skip_nonfinite`, or loss scaling).
        counts_towards_streak: Boolean scalar, whether a drop counts
            towards the divergence streak (`divergence.counts_as_failure`,
            `keep`); `None`: every
            drop counts.
        global_normaliser: float32, the normaliser summed over replicas.
        norm: `None`, or the gradient's global norm as `(unit, root)`
            (`maths.norms.scaled_norm`) when the check was made on it
            (`checks_norm`); `keep` then also requires a clip factor that
            is a normal float (`maths.norms.fits_clip`).
    """

    marks: Any
    all_finite: Any
    keep: Any
    drops_nonfinite: bool
    counts_towards_streak: Any
    global_normaliser: Any
    norm: Any


def checks(drops_nonfinite, log_keys):
    """Whether each micro-batch is checked at all (a Python bool).

    Args:
        drops_nonfinite: Python bool: non-finite micro-batches are dropped.
        log_keys: Set of the requested telemetry keys.

    Returns:
        `True` while non-finite micro-batches are dropped or a key reads
        their count (`COUNT_KEYS`); `False`: nothing is checked, and every
        update is applied as `keras.Model` applies it.

    Example:

    >>> checks(False, {"grad_norm"}), checks(False, {"nonfinite_count"})
    (False, True)
    """
    return bool(drops_nonfinite or set(log_keys) & COUNT_KEYS)


def checks_norm(clip_norm, clip_adaptive, own_gradient):
    """Whether the finite check is the gradient's global norm (a Python
    bool): `clip_norm` needs that norm for the update anyway, and the update
    is the micro-batch's own gradient as it is (`own_gradient`: one replica,
    no accumulation, not divided, the update gated in the step's one
    `cond`); not with `clip_adaptive` (the update's norm is then the
    adaptively clipped one).

    Not for the `grad_norm` key alone: the norm's check is exact (every
    element finite), the element sums' also drops a gradient whose sum
    overflows float32, so a key would change which micro-batches train.

    Example:

    >>> checks_norm(1.0, None, True), checks_norm(None, None, True)
    (True, False)
    """
    return clip_norm is not None and clip_adaptive is None and bool(own_gradient)


def norm_finite(scaled, loss_finite):
    """Boolean scalar: the micro-batch is finite, checked on the gradient's
    norm (`checks_norm`): its `root` (`maths.norms.scaled_norm`, computed
    without overflow) is finite exactly when every element is; and the
    loss (`loss_finite`, boolean scalar).

    Example:

    >>> nan, t = ops.convert_to_tensor(float("nan")), ops.convert_to_tensor(True)
    >>> bool(norm_finite((1.0, ops.convert_to_tensor(5.0)), t)), bool(norm_finite((1.0, nan), t))
    (True, False)
    """
    return ops.logical_and(ops.isfinite(scaled[1]), loss_finite)


def keep(finite, update_ok=None, counts=None):
    """What a gated step keeps, and which drop counts towards the streak.

    Args:
        finite: Boolean scalar, the micro-batch is finite.
        update_ok: Boolean scalar, or `None`: its update may be applied (a
            clip factor that is a normal float, AGC's unit norms finite).
        counts: Boolean scalar (`divergence.counts_as_failure`), or
            `None`: every drop counts.

    Returns:
        Tuple `(keep, counts)`: `finite and update_ok`; the drops that
        count: `counts`, and every refused update of a finite gradient
        (`None` where every drop counts).

    Example:

    >>> t, f = ops.convert_to_tensor(True), ops.convert_to_tensor(False)
    >>> kept, counts = keep(t, f, f)  # finite, its clip factor refused
    >>> bool(kept), bool(counts)
    (False, True)
    """
    if update_ok is None:
        return finite, counts
    kept = ops.logical_and(finite, update_ok)
    if counts is None:
        return kept, None
    return kept, ops.logical_or(counts, ops.logical_and(finite, ops.logical_not(kept)))


def update_check(gated, checked, clip_norm, adaptive, own_gradient):
    """What the update checks right before it is applied.

    Args:
        gated: Python bool: non-finite micro-batches are dropped (without
            the gate a non-finite update is applied, as `keras.Model`).
        checked: Python bool: the micro-batch's check was its norm
            (`checks_norm`), which covered the update's too.
        clip_norm: Python float or `None`.
        adaptive: Python bool: AGC checks the update (its unit norms are
            finite exactly when the gradient is and none overflowed).
        own_gradient: Python bool: the update is the micro-batch's own
            gradient, already checked (one replica, no accumulation; a
            division by the normaliser keeps it finite, and so does
            clipping: its factor is computed without overflow).

    Returns:
        `None` (nothing left to check), `"norm"` (the norm finite and the
        clip factor a normal float, `maths.norms.fits_clip`) or `"sums"`
        (every gradient finite: a window's or the replicas' sum of finite
        gradients can overflow).

    Example:

    >>> update_check(True, False, 1.0, False, True)
    'norm'
    >>> update_check(True, False, None, False, False), update_check(False, False, 1.0, False, False)
    ('sums', None)
    """
    if not gated or checked:
        return None
    if clip_norm is not None:
        return "norm"
    if adaptive or own_gradient:
        return None
    return "sums"
