"""The quick-start demo runs on bundled data and its exactness claim holds."""

import pytest

from keras_fastgrad import demo

pytestmark = pytest.mark.slow  # the whole demo program


def test_demo_runs_and_accumulation_is_exact_on_digits(capsys):
    result = demo.main(["--epochs", "1"])
    out = capsys.readouterr().out
    assert "test accuracy" in out and "grad_norm" in out
    # Reference: keras.Model on the equivalent 128-sample batches.
    assert result["exact_diff"] < 1e-5
    assert result["keras_diff"] > 100 * result["exact_diff"]
