"""The quick-start demo runs on bundled data and its exactness claim holds;
without scikit-learn it names the extra to install."""

import sys

import pytest

from keras_fastgrad import demo

pytestmark = pytest.mark.tensorflow_only(
    reason="the demo on TensorFlow (on JAX: tests/test_without_tensorflow_jax.py)"
)


@pytest.mark.slow  # the whole demo program
def test_demo_runs_and_accumulation_is_exact_on_digits(capsys):
    result = demo.main(["--epochs", "1"])
    out = capsys.readouterr().out
    assert "test accuracy" in out and "grad_norm" in out
    # Reference: keras.Model on the equivalent 128-sample batches.
    assert result["exact_diff"] < 1e-5
    assert result["keras_diff"] > 100 * result["exact_diff"]


def test_without_scikit_learn_the_demo_names_the_extra_to_install(monkeypatch):
    # `pip install -e ".[jax]"` installs no scikit-learn: the demo said
    # "No module named 'sklearn'" from deep in its import.
    import keras

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    extras = "jax,demo" if keras.backend.backend() == "jax" else "tf-cpu,demo"
    with pytest.raises(ImportError, match=rf'scikit-learn.*Fix: pip install -e "\.\[{extras}\]"'):
        demo.load_digits()
    assert 'Fix: pip install -e ".[tf-cpu,demo]"' in demo.missing_scikit_learn("tensorflow")


def test_the_variables_line_says_what_each_backend_differentiates():
    # No tape on JAX: the line there names `jax.value_and_grad`.
    assert "tape" not in demo.variables_line("jax", 6, 6)
    assert demo.variables_line("jax", 6, 6).endswith(": 6 of 6 trainable")
    assert "gradient tape" in demo.variables_line("tensorflow", 6, 6)
