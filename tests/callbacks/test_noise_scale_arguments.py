"""`GradientNoiseScale`'s `decay`: its message states the rule the check
enforces, the open interval (0, 1), at both ends and beyond them."""

import re

import pytest

from keras_fastgrad.callbacks import GradientNoiseScale

RULE = r"`decay` must be a number > 0\.0 and < 1\.0 .*both ends excluded.*Received: decay="


@pytest.mark.parametrize("decay", [0.0, 1.0, 0, 1, -0.1, 1.5, float("nan"), float("inf")])
def test_both_ends_and_beyond_are_refused_with_the_rule_enforced(decay):
    with pytest.raises(ValueError, match=RULE + re.escape(repr(decay))):
        GradientNoiseScale(decay=decay)


@pytest.mark.parametrize("decay", ["0.9", True, None])
def test_a_non_number_is_refused_with_the_same_rule(decay):
    with pytest.raises(ValueError, match=RULE):
        GradientNoiseScale(decay=decay)


@pytest.mark.parametrize("decay", [1e-6, 0.5, 0.999999])
def test_values_just_inside_are_accepted(decay):
    assert GradientNoiseScale(decay=decay, verbose=0).decay == decay
