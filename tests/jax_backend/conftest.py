"""tests/jax_backend: keras_fastgrad on Keras' JAX backend. Run with
`KERAS_BACKEND=jax .venv/bin/python -m pytest -q -n 2 -p no:randomly tests/jax_backend`;
skipped as a whole on any other backend."""

import keras
import pytest


def pytest_collection_modifyitems(config, items):
    if keras.backend.backend() == "jax":
        return
    skip = pytest.mark.skip(reason="tests/jax_backend need KERAS_BACKEND=jax")
    for item in items:
        if "tests/jax_backend/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
