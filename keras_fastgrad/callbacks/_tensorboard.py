"""Host-side TensorBoard writing for the callbacks.

`tf.summary` ops cannot run inside an XLA-compiled step, so the callbacks
write from the host, after the step's values have reached the logs. The
events are written with core TensorFlow's `tf.summary.write` and the plugin
metadata `tf.summary.scalar` / `tf.summary.histogram` would attach, so no
`tensorboard` package is needed to write them. TensorFlow is imported when
a writer is made (on Keras' JAX backend too: only then).
"""

import os

import keras
import numpy as np

from keras_fastgrad._tf_startup import tf

HISTOGRAM_BUCKETS = 30


def _plugin_metadata(plugin_name):
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin_name)
    ).SerializeToString()


def histogram_buckets(values, bucket_count=HISTOGRAM_BUCKETS):
    """TensorBoard's histogram tensor: rows of (left edge, right edge, count).

    >>> histogram_buckets([0.0, 1.0, 1.0], bucket_count=2)
    array([[0. , 0.5, 1. ],
           [0.5, 1. , 2. ]])
    """
    values = np.asarray(values, np.float64).ravel()
    if values.size == 0:
        return np.zeros((0, 3))
    low, high = values.min(), values.max()
    if low == high:
        return np.array([[low, high, float(values.size)]])
    counts, edges = np.histogram(values, bins=bucket_count, range=(low, high))
    return np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)


class SummaryWriter:
    """Writes scalars and weight histograms into `<directory>/train`, the
    sub-directory `keras.callbacks.TensorBoard` uses for training curves."""

    def __init__(self, directory):
        try:
            self._writer = tf.summary.create_file_writer(os.path.join(directory, "train"))
        except ImportError as error:
            raise ImportError(
                "`tensorboard_dir` needs TensorFlow, which writes the events. "
                f"Received: tensorboard_dir={directory!r}, TensorFlow not "
                "importable. Fix: `pip install tensorflow` (the events are written "
                "on any Keras backend), or `tensorboard_dir=None`."
            ) from error
        self._scalar = _plugin_metadata("scalars")
        self._histogram = _plugin_metadata("histograms")

    def scalars(self, values, step, prefix=""):
        """Writes each `{tag: float}` as `prefix + tag` at `step`."""
        with self._writer.as_default(step=step):
            for tag, value in values.items():
                tensor = tf.constant(value, tf.float32)
                tf.summary.write(prefix + tag, tensor, metadata=self._scalar)

    def histograms(self, variables, step):
        """One histogram per variable, tagged with its path (reads it to host)."""
        with self._writer.as_default(step=step):
            for v in variables:
                buckets = histogram_buckets(keras.ops.convert_to_numpy(v))
                tf.summary.write(v.path, buckets, metadata=self._histogram)

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()
