"""pytest plugin: Keras' own tests with `keras.Model` swapped for
`FastGradModel` (and `keras.Sequential` for `FastGradSequential` when
`KERAS_SWAP_SEQUENTIAL=1`). Used by `tools/keras_suite.py`.

Only what the tests see is rebound: `keras.Model` / `keras.models.Model`
and the `Model` (`Sequential`) names in the collected test modules; Keras'
own modules keep their classes (FastGradModel subclasses them)."""

import os

import keras
import pytest

import keras_fastgrad

_SWAPS = {"Model": (keras.Model, keras_fastgrad.FastGradModel)}
if os.environ.get("KERAS_SWAP_SEQUENTIAL") == "1":
    _SWAPS["Sequential"] = (keras.Sequential, keras_fastgrad.FastGradSequential)


def pytest_configure(config):
    for name, (original, swap) in _SWAPS.items():
        for module in (keras, keras.models):
            if getattr(module, name, None) is original:
                setattr(module, name, swap)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for name, (original, swap) in _SWAPS.items():
            if getattr(module, name, None) is original:
                setattr(module, name, swap)
