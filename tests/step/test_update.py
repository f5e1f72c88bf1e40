"""Unit tests of the update's order (`keras_fastgrad.step.update`), written
once for both backends' steps and run under each (`KERAS_BACKEND`).

The shell here records what the chain asks of it, in order, on
`keras.ops` values; the references are worked out by hand from the
documented chain (divide -> noise record -> adaptive clip -> per-layer
norms -> clip -> check -> apply or drop -> records): a gradient (6, 8)
divided by 2 is (3, 4), norm 5; `clip_norm=1` scales it by 0.2 to
(0.6, 0.8).
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from keras import ops

from keras_fastgrad.maths import finite, norms
from keras_fastgrad.step import update


class Shell:
    """A shell that records each call (its name and, for gradients, their
    values as lists), branching in Python on the predicate's value."""

    def __init__(self, clip_norm=None, gated=True, log_keys=(), agc_ok=None, clip_adaptive=None):
        self.options = SimpleNamespace(clip_norm=clip_norm, clip_adaptive=clip_adaptive)
        self.gated, self.log_keys, self._agc_ok = gated, set(log_keys), agc_ok
        self.calls = []

    def _log(self, name, grads=None):
        values = None if grads is None else [np.asarray(g).tolist() for g in grads]
        self.calls.append((name, values))

    def divided(self, grads, normaliser):
        return [g / normaliser for g in grads]

    def scaled_by(self, grads, factor):
        return [g * factor for g in grads]

    scaled_norm = staticmethod(norms.scaled_norm)
    global_norm = staticmethod(norms.global_norm)

    def all_finite(self, grads):
        self._log("all_finite")
        return finite.all_finite(grads)

    def record_noise(self, grads):
        self._log("noise", grads)

    def adaptive_clip(self, grads, computed):
        self._log("agc", grads)
        return grads, (None if self._agc_ok is None else ops.convert_to_tensor(self._agc_ok))

    def record_gradient(self, grads):
        self._log("layer_norms", grads)

    def branch(self, pred, applied, dropped):
        if pred is None or bool(pred):
            applied()
        else:
            dropped()

    def apply(self, grads, factor):
        self._log("apply", grads if factor is None else [g * factor for g in grads])

    def record(self, change, where=None):
        self.calls.append(("record", _counted(change), None if where is None else bool(where)))


def _counted(change):
    """The change's counts that are set (`updates`, `nonfinite_count`, ...),
    and whether it is a failure / an applied update."""
    counts = {
        k: (bool(v) if not isinstance(v, (int, float)) else v)
        for k, v in change.counters._asdict().items()
        if v is not None and k in {"updates", "nonfinite_count", "clipped_updates"}
    }
    return counts, change.failed, change.applied


def grads_of(*values):
    return [ops.convert_to_tensor(np.array(values, "float32"))]


def test_the_order_divide_noise_agc_norms_clip_apply():
    shell = Shell(clip_norm=1.0)
    prepared = update.prepare(shell, grads_of(6.0, 8.0), normaliser=2.0)
    update.apply_or_drop(shell, prepared)
    names = [c[0] for c in shell.calls]
    assert names == ["noise", "agc", "layer_norms", "apply", "record"]
    # The noise scale and AGC see the divided, unclipped gradient; the
    # per-layer norms the gradient after AGC, before `clip_norm`.
    for call in shell.calls[:3]:
        assert call[1] == [[3.0, 4.0]]
    np.testing.assert_allclose(shell.calls[3][1], [[0.6, 0.8]], rtol=1e-6)
    assert math.isclose(float(prepared.norm), 5.0, rel_tol=1e-6)
    assert bool(prepared.was_clipped) and bool(prepared.ok)
    counts, failed, applied = shell.calls[4][1]
    assert counts["updates"] is True and applied is True and failed is False


def test_a_gated_window_sum_that_overflowed_is_dropped_and_counted():
    shell = Shell()  # no clipping: the check is every gradient finite
    prepared = update.prepare(shell, grads_of(1.0, float("inf")))
    update.apply_or_drop(shell, prepared)
    names = [c[0] for c in shell.calls]
    assert names == ["noise", "agc", "layer_norms", "all_finite", "record"]
    counts, failed, applied = shell.calls[-1][1]
    assert counts == {"nonfinite_count": True} and failed is True and applied is None


def test_the_micro_batchs_own_gradient_is_not_checked_again():
    shell = Shell()
    prepared = update.prepare(shell, grads_of(1.0, float("nan")), own=True)
    assert prepared.ok is None  # the verdict checked it
    update.apply_or_drop(shell, prepared)
    assert "all_finite" not in [c[0] for c in shell.calls]
    assert [c[0] for c in shell.calls][-2:] == ["apply", "record"]


def test_a_norm_beyond_the_clip_factors_range_is_refused():
    # 1e38 * 2**80 ~ 1.2e62: finite as `unit * root`, but `clip_norm / norm`
    # would flush to 0 (below float32's smallest normal).
    shell = Shell(clip_norm=1.0)
    scaled = (ops.convert_to_tensor(2.0**80), ops.convert_to_tensor(1e38))
    prepared = update.prepare(shell, grads_of(1.0), scaled=None)
    assert bool(prepared.ok)
    folded = update.prepare(Shell(clip_norm=1.0), grads_of(1.0), scaled=scaled, fold=True)
    assert not bool(folded.ok)  # the verdict's norm, the factor's limit still checked
    assert folded.factor is not None  # multiplied in the update, not here


@pytest.mark.parametrize("counted", [True, False])
def test_an_update_agc_refused_counts_once(counted):
    # `skip_nonfinite=False` with a `nonfinite_*` key: the micro-batches were
    # counted at their verdict; AGC's refusal adds a count only for a
    # finite gradient (an overflow), the failure always.
    keys = {"nonfinite_count"} if counted else set()
    shell = Shell(gated=False, log_keys=keys, agc_ok=False, clip_adaptive=0.01)
    prepared = update.prepare(shell, grads_of(1.0))
    update.apply_or_drop(shell, prepared, finite=lambda: ops.convert_to_tensor(False))
    records = [c for c in shell.calls if c[0] == "record"]
    if counted:  # counters where finite (here: not), then the failure
        assert [r[2] for r in records] == [False, None]
        assert records[0][1][0] == {"nonfinite_count": True} and records[0][1][1] is False
        assert records[1][1][0] == {} and records[1][1][1] is True
    else:
        assert len(records) == 1 and records[0][1][0] == {"nonfinite_count": True}


def test_recorded_is_the_records_alone():
    shell = Shell()
    update.recorded(shell, ops.convert_to_tensor(False), None, None)
    assert [c[0] for c in shell.calls] == ["record"]
    assert shell.calls[0][1][1] is True  # a failure
