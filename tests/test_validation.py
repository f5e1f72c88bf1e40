"""The generic argument checks of `keras_fastgrad._validation` (shared by
the models, callbacks and profiling), called directly; the model's options
are checked in `models/test_options.py`."""

import numpy as np
import pytest

from keras_fastgrad._validation import check_bool


@pytest.mark.parametrize(
    "value, shown",
    [
        (1, "1 of type int"),
        (0, "0 of type int"),
        (np.int64(1), r"np.int64\(1\) of type int64"),
        ("True", "'True' of type str"),
        (None, "None of type NoneType"),
        (np.array([True]), r"array\(\[ True\]\) of type ndarray"),
    ],
)
def test_check_bool_refuses_non_booleans(value, shown):
    with pytest.raises(
        TypeError, match=rf"`flag` must be a boolean \(True or False\)\. Received: flag={shown}\."
    ):
        check_bool("flag", value)


def test_check_bool_returns_python_bools():
    assert check_bool("flag", True) is True and check_bool("flag", False) is False
    assert check_bool("flag", np.True_) is True and check_bool("flag", np.False_) is False
