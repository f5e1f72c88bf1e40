"""Unit tests of the verdict's rules (`keras_fastgrad.step.verdict`), written
once for both backends' steps and run under each (`KERAS_BACKEND`).

References: a truth table written out by hand from the rules as the
documentation states them (docs: a micro-batch is kept when finite and its
update may be applied; a drop counts towards the divergence streak, except
an overflow under loss scaling above scale 1; a refused clip factor always
counts), not computed by the functions under test.
"""

import itertools

import keras
import pytest

from keras_fastgrad.step import divergence, verdict


def b(value):
    return keras.ops.convert_to_tensor(value)


def value(x):
    return None if x is None else bool(keras.ops.convert_to_numpy(x))


# (finite, update_ok, counts) -> (keep, counts), by hand.
KEEP = {
    (True, None, None): (True, None),
    (False, None, None): (False, None),
    (True, True, False): (True, False),
    (True, False, False): (False, True),  # a refused factor counts
    (False, True, False): (False, False),  # an overflow above scale 1
    (False, True, True): (False, True),
    (False, False, True): (False, True),
    (True, False, None): (False, None),  # every drop counts
}


@pytest.mark.parametrize("case", sorted(KEEP, key=str))
def test_keep_and_what_counts(case):
    finite, ok, counts = case
    kept, counted = verdict.keep(
        b(finite), None if ok is None else b(ok), None if counts is None else b(counts)
    )
    expected_keep, expected_counts = KEEP[case]
    assert value(kept) == expected_keep
    if expected_counts is None:
        assert counted is None
    elif not expected_keep:  # (only read where the micro-batch is dropped)
        assert value(counted) is expected_counts


@pytest.mark.parametrize("finite, scale, expected", [
    (True, None, False),
    (False, None, True),
    (False, 2.0, False),  # an overflow finds the scale's level: not a failure
    (False, 1.0, True),
    (False, 0.5, True),
    (True, 0.5, False),
])  # fmt: skip
def test_counts_as_failure(finite, scale, expected):
    s = None if scale is None else b(scale)
    assert value(divergence.counts_as_failure(b(finite), s)) is expected


def test_checks_and_checks_norm():
    assert verdict.checks(True, set()) and not verdict.checks(False, {"grad_norm"})
    for key in ("nonfinite_count", "nonfinite_first_index", "nonfinite_num_variables"):
        assert verdict.checks(False, {key})
    # The norm is the check only with `clip_norm`, without AGC, on the
    # micro-batch's own gradient.
    for clip_norm, agc, own in itertools.product((None, 1.0), (None, 0.01), (False, True)):
        expected = clip_norm == 1.0 and agc is None and own
        assert verdict.checks_norm(clip_norm, agc, own) is expected


# (gated, checked, clip_norm, adaptive, own_gradient) -> the update's check, by hand.
UPDATE_CHECK = {
    (False, False, 1.0, False, False): None,  # ungated: applied as keras.Model
    (True, True, 1.0, False, True): None,  # the verdict's norm covered it
    (True, False, 1.0, False, True): "norm",  # the factor must be normal
    (True, False, 1.0, True, False): "norm",
    (True, False, None, True, False): None,  # AGC's flag covers it
    (True, False, None, False, True): None,  # the micro-batch's own, checked
    (True, False, None, False, False): "sums",  # a window's sum can overflow
}


@pytest.mark.parametrize("case", sorted(UPDATE_CHECK, key=str))
def test_update_check(case):
    assert verdict.update_check(*case) == UPDATE_CHECK[case]
