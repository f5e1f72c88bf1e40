"""Unit tests of one micro-batch's order before its update
(`keras_fastgrad.step.micro_batch`), written once for both backends' steps
and run under each (`KERAS_BACKEND`).

The shell here records each drop it is asked to write, with its mask;
the references are the documented rules worked out by hand: a gated step
drops a non-finite micro-batch (counted, a failure unless loss scaling
says otherwise) in a branch the step has where it can; an ungated step
applies it and counts it only while a count key asks, never a failure.
"""

import numpy as np
import pytest
from keras import ops

from keras_fastgrad.step import micro_batch


class Shell:
    """Records each `record_drop(where)` as the mask's Python bool."""

    def __init__(self, gated=True, log_keys=()):
        self.gated, self.log_keys = gated, set(log_keys)
        self.drops = []

    def record_drop(self, where):
        self.drops.append(bool(where))


T, F = ops.convert_to_tensor(True), ops.convert_to_tensor(False)


@pytest.mark.parametrize(
    "gated, keys, accumulating, window_branch, place",
    [
        (True, (), False, True, "update"),  # the update's `cond` holds it
        (True, (), False, False, "update"),
        (True, (), True, True, "window"),  # the window's `cond` holds it
        (True, (), True, False, "own"),  # (replicas; JAX's window)
        (False, (), False, True, None),  # ungated, nothing asks: no check
        (False, ("updates", "grad_norm"), True, True, None),
        (False, ("nonfinite_count",), False, True, "own"),
        (False, ("nonfinite_first_index",), True, True, "own"),
    ],
)
def test_where_each_drop_is_recorded(gated, keys, accumulating, window_branch, place):
    assert micro_batch.drop_place(gated, set(keys), accumulating, window_branch) == place


@pytest.mark.parametrize("finite, recorded", [(T, [False]), (F, [True])])
def test_a_drop_at_its_own_gate_is_written_where_not_finite(finite, recorded):
    shell = Shell(gated=False, log_keys={"nonfinite_count"})
    assert micro_batch.before_update(shell, finite, accumulating=False) == "own"
    assert shell.drops == recorded


@pytest.mark.parametrize(
    "gated, keys, accumulating, window_branch",
    [
        (True, (), False, True),  # written in the update's other branch
        (True, (), True, True),  # written in the window's other branch
        (False, ("updates",), False, True),  # not counted at all
    ],
)
def test_no_drop_is_written_before_the_update_where_a_branch_holds_it(
    gated, keys, accumulating, window_branch
):
    shell = Shell(gated, keys)
    micro_batch.before_update(shell, F, accumulating, window_branch)
    assert shell.drops == []


def test_what_is_kept():
    assert micro_batch.kept(F, True) is F  # gated: the verdict
    assert micro_batch.kept(F, False) is True  # applied, as keras.Model does


def test_loss_scale_growth_counts_micro_batches_only_without_accumulation():
    assert micro_batch.grows_per_micro_batch(False) is True
    assert micro_batch.grows_per_micro_batch(True) is False


def _marks():
    # The element sums of two gradients and the loss: the second gradient's
    # not finite, the loss finite.
    return ops.convert_to_tensor(np.array([3.0, np.nan, 0.5], "float32"))


def test_a_gated_drop_is_counted_located_and_a_failure():
    change = micro_batch.dropped({"nonfinite_first_index"}, _marks)
    assert change.counters.nonfinite_count is True
    assert float(change.counters.nonfinite_first_index) == 1.0
    assert float(change.counters.nonfinite_num_variables) == 1.0
    assert change.failed is True  # no loss scaling: every drop counts


def test_a_gated_drop_under_loss_scaling_is_a_failure_where_the_scale_says():
    change = micro_batch.dropped(set(), _marks, failed=F)
    assert change.counters.nonfinite_count is True
    assert change.failed is F
    assert change.counters.nonfinite_first_index is None  # not asked: left as it was


def test_an_ungated_count_is_never_a_failure():
    change = micro_batch.dropped({"nonfinite_count"}, _marks, failed=T, gated=False)
    assert change.counters.nonfinite_count is True
    assert change.failed is False
    assert change.applied is None  # the streak is not reset either


def test_the_marks_are_read_only_while_a_location_key_asks():
    def never():
        raise AssertionError("marks read without a location key")

    assert micro_batch.dropped({"nonfinite_count"}, never).counters.nonfinite_count is True
