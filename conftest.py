"""Shared pytest setup: a clean Keras session per test and the doctest
namespace of the public docstrings' examples."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def clean_keras_state():
    """Every test starts from a fresh Keras session and float32 policy."""
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(autouse=True)
def doctest_namespace_setup(doctest_namespace):
    import tensorflow as tf

    import keras_fastgrad

    doctest_namespace.update({"np": np, "keras": keras, "tf": tf, "keras_fastgrad": keras_fastgrad})
