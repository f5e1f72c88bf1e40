"""The update's order, written once for both backends' steps.

    [divide by the normaliser] -> noise-scale record -> adaptive clip
      -> gradient measures -> clip (`clip_norm`) -> the update's check
      -> apply, or drop -> the event's records

`prepare` runs the chain up to the check and `apply_or_drop` the rest;
`recorded` is the records alone (JAX's window applies inside its own
`lax.cond` and records after it). The rules each step calls are the core's
(`step.verdict.update_check`, `maths.norms.clip`,
`step.adaptive_clipping`, `step.telemetry`'s changes); what differs by
backend comes in through a shell object, which says only *how*:

- `options`, `gated` (non-finite micro-batches are dropped), `log_keys`;
- `divided(grads, normaliser)`, `scaled_by(grads, factor)`: the gradient's
  arithmetic (TensorFlow's sparse rows, fused ops);
- `scaled_norm(grads)`, `global_norm(grads)`, `all_finite(grads)`;
- `record_noise(grads)`, `adaptive_clip(grads, computed)` (`(grads, ok)`),
  `record_gradient(grads)` (the per-layer norms, before clipping);
- `branch(pred, applied, dropped)`: `applied()` where `pred` holds,
  `dropped()` elsewhere (`pred` `None`: always applied): TensorFlow's
  `tf.cond` (a call without one for `None`), or `Masked`'s (both run in
  Python, the records selected by the branch's mask: JAX's, where a
  traced branch cannot assign and `lax.cond` runs only the optimizer);
- `apply(grads, factor)`: the optimizer's step in the applied branch, and
  what it measures (`factor`: `None`, or the clip factor the update
  multiplies by);
- `record(change, where=None)`: a `step.telemetry.Change` written in the
  current branch (`where`: a further boolean scalar within it).

`Shell` holds the `keras.ops` forms a shell may keep (the arithmetic, the
norms, the check, nothing recorded); `Masked` the branches by mask.
"""

from typing import Any, NamedTuple

from keras import ops

from keras_fastgrad.maths import finite, norms
from keras_fastgrad.step import adaptive_clipping as agc_rules
from keras_fastgrad.step import telemetry as records
from keras_fastgrad.step import verdict as rules


class Prepared(NamedTuple):
    """The update, ready to apply (`prepare`).

    Fields:
        grads: The gradient to apply (clipped, unless `factor` is given).
        factor: `None`, or the clip factor the update multiplies `grads`
            by (`prepare(fold=True)`).
        norm: float32 scalar, the norm before `clip_norm` (the `grad_norm`
            key, `clipped_updates`), or `None` (not measured).
        was_clipped: Boolean scalar, or `None` without `clip_norm`.
        ok: Boolean scalar, whether the update may be applied (its check,
            `verdict.update_check`, with AGC's); `None`: nothing to check.
    """

    grads: Any
    factor: Any
    norm: Any
    was_clipped: Any
    ok: Any


def prepare(shell, grads, normaliser=None, scaled=None, computed=None, own=False, fold=False):
    """The update's gradient, from the combined gradients to its check.

    Args:
        shell: The backend's primitives (the module docstring).
        grads: The update's gradients (summed over the window or the
            replicas, unscaled).
        normaliser: float32 scalar the sums are divided by, or `None`.
        scaled: The norm `(unit, root)` when the micro-batch's check was
            that norm (`verdict.checks_norm`): not measured again, nothing
            left to check.
        computed: AGC's `Clipped`, computed before the update's gate
            (`adaptive_clipping.before_gate`), or `None`.
        own: Python bool: the micro-batch's own gradient, already checked
            (`verdict.update_check`).
        fold: Python bool: the check joins the micro-batch's verdict (one
            gate: the factor's limit is checked even where the norm was
            the verdict's) and the clip factor is multiplied in the update.

    Returns:
        A `Prepared`.
    """
    options, gated = shell.options, shell.gated
    clip_norm = options.clip_norm
    if normaliser is not None:
        grads = shell.divided(grads, normaliser)
    shell.record_noise(grads)  # the big batch: unscaled, unclipped
    grads, agc_ok = shell.adaptive_clip(grads, computed)  # (grads, None): AGC off
    shell.record_gradient(grads)  # `grad_norm/<layer>`: after AGC, before `clip_norm`
    check = rules.update_check(gated, scaled is not None, clip_norm, agc_ok is not None, own)
    factor = was_clipped = ok = None
    if clip_norm is None:
        norm = shell.global_norm(grads) if "grad_norm" in shell.log_keys else None
    else:
        # Gated: applied only where the norm is finite (the verdict's, or
        # this update's check): no NaN guard in the factor.
        fit = check == "norm" or (fold and gated)  # (the fit checked here)
        scaled = scaled or shell.scaled_norm(grads)
        clipping = norms.clip(clip_norm, checked=gated, fit=fit, scaled=scaled)
        factor, norm, was_clipped, ok = clipping
        if not fold:
            grads, factor = shell.scaled_by(grads, factor), None
    if check == "sums":  # a window's or the replicas' sum can overflow
        ok = shell.all_finite(grads)
    return Prepared(grads, factor, norm, was_clipped, agc_rules.both_finite(ok, agc_ok))


def apply_or_drop(shell, update, finite=None, dropped=None):
    """The prepared update applied where its check holds, with its records;
    dropped (counted, a failure) elsewhere.

    Args:
        shell: The backend's primitives.
        update: A `Prepared` (its `ok` the gate).
        finite: Callable giving the boolean scalar "the update's gradient
            was finite", read where a drop may have been counted at the
            micro-batches' verdict already
            (`adaptive_clipping.counted_at_verdict`); `None`: never.
        dropped: Callable recording the drop instead (the micro-batch's
            own, where the check joined its verdict), or `None`.
    """

    def applied():
        shell.apply(update.grads, update.factor)
        shell.record(records.update_applied(update.norm, update.was_clipped))

    shell.branch(update.ok, applied, dropped or (lambda: _dropped(shell, finite)))


def recorded(shell, ok, norm, was_clipped, finite=None):
    """`apply_or_drop`'s records alone, for an update applied already (JAX's
    window, inside its `lax.cond`): `ok` as `Prepared.ok`."""
    applied = lambda: shell.record(records.update_applied(norm, was_clipped))  # noqa: E731
    shell.branch(ok, applied, lambda: _dropped(shell, finite))


def _dropped(shell, finite):
    """A refused update: counted, and a failure; counted once where its
    micro-batches were counted at their verdict (`records.counted_once`)."""
    change = records.update_dropped()
    options = shell.options
    if finite is not None and agc_rules.counted_at_verdict(
        options.clip_adaptive, shell.gated, shell.log_keys
    ):
        counters_only, change = records.counted_once(change)
        shell.record(counters_only, where=finite())
    shell.record(change)


class Shell:
    """The primitives in `keras.ops` (dense gradients), for a shell to keep
    or override; no noise scale or per-layer norms recorded.

    Attributes (the shell's): `options` (`StepOptions`), `gated` (Python
    bool), `log_keys` (set of the requested keys).
    """

    scaled_norm = staticmethod(norms.scaled_norm)
    global_norm = staticmethod(norms.global_norm)
    all_finite = staticmethod(finite.all_finite)

    @staticmethod
    def divided(grads, normaliser):
        return [g / normaliser for g in grads]

    @staticmethod
    def scaled_by(grads, factor):
        return [g * factor for g in grads]

    def record_noise(self, grads):
        pass

    def record_gradient(self, grads):
        pass


class Masked(Shell):
    """Branches by mask: both of a branch's functions run (in Python, in
    order), each under its mask (`where`: `True`, or a boolean scalar; the
    applied branch's is kept as `applied`), which the shell's `apply` and
    `record` select by. Subclasses write `write(change, mask)`."""

    where = applied = True

    def branch(self, pred, applied, dropped):
        outer = self.where
        if pred is None:
            self.applied = outer
            applied()
            return
        self.where = self.applied = self._within(outer, pred)
        applied()
        self.where = self._within(outer, ops.logical_not(pred))
        dropped()
        self.where = outer

    def record(self, change, where=None):
        self.write(change, self.where if where is None else self._within(self.where, where))

    @staticmethod
    def _within(outer, mask):
        return mask if outer is True else ops.logical_and(outer, mask)
