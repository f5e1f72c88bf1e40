"""Multi-task gradient aggregators in coefficient space.

`T` task gradients flattened into `J` (`T x P`) are merged as `w^T J`; an
aggregator only sees the Gram matrix `G = J J^T` (`T x T`, `T` static) and
returns the task weights `w` (`[T]`, the dtype of `G`). All of them are
written in `keras.ops`, the same code on Keras' TensorFlow and JAX backends:
they trace in graph mode and compile with `tf.function(jit_compile=True)` on
TensorFlow, and with `jax.jit` on JAX (`G` may be a TensorFlow tensor, a JAX
array or NumPy).

Example:

>>> from keras import ops
>>> from keras_fastgrad import aggregators
>>> J = np.array([[1.0, 0.0], [-1.0, 1.0]])  # 2 tasks, P = 2
>>> gram = J @ J.T
>>> w = ops.convert_to_numpy(aggregators.get("mgda").weights(gram))
>>> w.round(4).tolist()
[0.6, 0.4]
>>> (w @ J).round(4).tolist()  # w^T J
[0.2, 0.4]
>>> int(aggregators.gram_telemetry(gram)["num_conflicts"])
1
"""

import keras
import numpy as np
from keras import ops

from keras_fastgrad.aggregators._aligned_mtl import AlignedMTL
from keras_fastgrad.aggregators._base import Aggregator, _check_gram
from keras_fastgrad.aggregators._cagrad import CAGrad
from keras_fastgrad.aggregators._config import ConFIG
from keras_fastgrad.aggregators._dualproj import DualProj
from keras_fastgrad.aggregators._gradvac import GradVac
from keras_fastgrad.aggregators._imtl import IMTL
from keras_fastgrad.aggregators._mean import Mean
from keras_fastgrad.aggregators._mgda import MGDA
from keras_fastgrad.aggregators._nashmtl import NashMTL
from keras_fastgrad.aggregators._pcgrad import PCGrad, pcgrad_weights
from keras_fastgrad.aggregators._sum import Sum
from keras_fastgrad.aggregators._upgrad import UPGrad

__all__ = [
    "Aggregator",
    "AlignedMTL",
    "CAGrad",
    "ConFIG",
    "DualProj",
    "GradVac",
    "IMTL",
    "MGDA",
    "Mean",
    "NAMES",
    "NashMTL",
    "PCGrad",
    "Sum",
    "UPGrad",
    "get",
    "gram_telemetry",
    "pcgrad_weights",
    "serialize",
]

NAMES = (
    "aligned",
    "cagrad",
    "config",
    "dualproj",
    "gradvac",
    "imtl",
    "mean",
    "mgda",
    "nashmtl",
    "pcgrad",
    "sum",
    "upgrad",
)


_CLASSES = {
    c.name: c
    for c in (
        Sum,
        Mean,
        PCGrad,
        MGDA,
        CAGrad,
        IMTL,
        AlignedMTL,
        UPGrad,
        DualProj,
        ConFIG,
        GradVac,
        NashMTL,
    )
}


def serialize(aggregator):
    """The Keras config dict of `aggregator` (`get` rebuilds it).

    Args:
        aggregator: An `Aggregator` instance.

    Returns:
        A JSON-serializable dict.

    Example:

    >>> config = serialize(get("cagrad"))
    >>> type(get(config)).__name__, get(config).c
    ('CAGrad', 0.5)
    """
    return keras.saving.serialize_keras_object(aggregator)


def get(identifier):
    """An `Aggregator` from a name in `NAMES`, an instance or a config dict.

    Args:
        identifier: A name from `NAMES` (case-insensitive), an `Aggregator`
            instance (returned as is), a config dict from `serialize`, or
            `None` (no aggregation, returned as `None`, as in Keras' `get`
            functions).

    Returns:
        An `Aggregator` or `None`.

    Raises:
        ValueError: for anything else, listing the valid names.

    Example:

    >>> type(get("pcgrad")).__name__
    'PCGrad'
    >>> get("pcgard")
    Traceback (most recent call last):
    ...
    ValueError: `multitask` must be one of [...] or an Aggregator instance. Received: multitask='pcgard'
    """
    if identifier is None or isinstance(identifier, Aggregator):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _CLASSES:
        return _CLASSES[identifier.lower()]()
    if isinstance(identifier, dict):
        name = str(identifier.get("class_name", "")).lower()
        if name in _CLASSES:
            return _CLASSES[name].from_config(identifier.get("config") or {})
        try:
            obj = keras.saving.deserialize_keras_object(identifier)
        except (TypeError, ValueError) as e:
            raise ValueError(
                "`multitask` config could not be deserialized into an "
                f"Aggregator. Received: multitask={identifier!r}"
            ) from e
        if isinstance(obj, Aggregator):
            return obj
    raise ValueError(
        f"`multitask` must be one of {list(NAMES)} or an Aggregator instance. "
        f"Received: multitask={identifier!r}"
    )


def gram_telemetry(gram):
    """Per-task gradient norms, pairwise cosines and conflicts from `G`.

    Args:
        gram: `[T, T]` Gram matrix `J J^T` of the task gradients.

    Returns:
        A dict: `"norms"` (`[T]`, `sqrt(diag G)`), `"cosine"` (`[T, T]`, 0
        where a norm is 0) and `"num_conflicts"` (int32, pairs `i < j` with
        `G_ij < 0`).

    Example:

    >>> t = gram_telemetry(np.array([[4.0, -2.0], [-2.0, 4.0]]))
    >>> ops.convert_to_numpy(t["norms"]).tolist(), float(t["cosine"][0, 1])
    ([2.0, 2.0], -0.5)
    >>> int(t["num_conflicts"])
    1
    """
    gram = _check_gram(gram)
    norms = ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0))
    positive = norms > 0
    inv = ops.where(positive, 1.0 / ops.where(positive, norms, ops.ones_like(norms)), 0.0)
    cosine = gram * inv[:, None] * inv[None, :]
    # The pairs i < j: a constant mask (the task count is static).
    upper = np.triu(np.ones(gram.shape, bool), k=1)
    conflicts = ops.sum(ops.cast(ops.logical_and(gram < 0, upper), "int32"))
    return {"norms": norms, "cosine": cosine, "num_conflicts": conflicts}
