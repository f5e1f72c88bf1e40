"""BatchNorm moments recorded, moving statistics held: the hook the
BatchNorm unit (`keras_fastgrad.step.batchnorm`, and the JAX shell's
`backend.jax.batchnorm`) installs on `BatchNormalization` layers.

`BatchNormalization.call(training=True)` takes the batch's moments with its
`_moments(inputs, mask)` and then assigns `moving_mean` and
`moving_variance`. While a recorder is active on a thread, each layer's
moments also go to the recorder and those two assigns do nothing: the
forward pass still normalises by the batch's own moments. Per thread
(`MirroredStrategy` traces each replica's step in a thread of its own),
installed once per layer however many threads record. Imports no backend
(Keras' private `_moments` through `keras_fastgrad._compat`).
"""

import contextlib
import threading

from keras_fastgrad import _compat as compat

_LOCK = threading.Lock()
_INSTALLS = {}  # id(layer) -> count of active `batchnorm_recording` blocks
_recorder = threading.local()


def _install_hooks(layer):
    moments = compat.batchnorm_moments(layer)
    moving = (layer.moving_mean, layer.moving_variance)

    def recorded_moments(inputs, mask):
        mean, variance = moments(inputs, mask)
        record = getattr(_recorder, "record", None)
        if record is not None:
            record(layer, inputs, mask, mean, variance)
        return mean, variance

    def held_assign(original):
        def assign(value, *args, **kwargs):
            held = getattr(_recorder, "held", None)
            if held is not None:
                held(layer)
                return None
            return original(value, *args, **kwargs)

        return assign

    compat.set_batchnorm_moments(layer, recorded_moments)
    for v in moving:
        vars(v)["assign"] = held_assign(v.assign)


def _remove_hooks(layer):
    compat.set_batchnorm_moments(layer, None)
    for v in (layer.moving_mean, layer.moving_variance):
        vars(v).pop("assign", None)


@contextlib.contextmanager
def batchnorm_recording(layers, record, held):
    """Records the moments of `layers` and holds their moving statistics
    within the block, on this thread.

    Args:
        layers: Built `keras.layers.BatchNormalization` layers.
        record: Called as `record(layer, inputs, mask, mean, variance)` with
            the moments each layer normalises by in training mode.
        held: Called as `held(layer)` instead of each assign to the layer's
            `moving_mean` or `moving_variance` (which then do nothing).

    Blocks nest, on one thread or several: the hooks are installed on a
    layer when its first block opens and removed when its last one closes.
    """
    with _LOCK:
        for layer in layers:
            count = _INSTALLS.get(id(layer), 0)
            if count == 0:
                _install_hooks(layer)
            _INSTALLS[id(layer)] = count + 1
    previous = vars(_recorder).copy()
    _recorder.record, _recorder.held = record, held
    try:
        yield
    finally:
        _recorder.record = previous.get("record")
        _recorder.held = previous.get("held")
        with _LOCK:
            for layer in layers:
                count = _INSTALLS.pop(id(layer)) - 1
                if count:
                    _INSTALLS[id(layer)] = count
                else:
                    _remove_hooks(layer)
