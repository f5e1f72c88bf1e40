"""How `micro_batches` splits a batch: as `numpy.array_split`, no padding.

A batch of n rows gives `k = min(m, n)` slices (one, empty, for an empty
batch), the first `n mod k` of `ceil(n / k)` rows and the others of
`floor(n / k)` (`slice_sizes`). `groups` gives the loops that run over
them (`keras_fastgrad.step.slicing`): outside XLA one loop, each slice
taken with a dynamic first dimension; under XLA, which needs static
shapes, one loop per slice size, the rows of each grouped as
`[slices, size, ...]` before it.
"""

import collections

from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf


def first_input(x):
    """The first input tensor of `x`: the step reads the batch size from it.

    Raises:
        ValueError: when `x` holds no tensor (`fit([None], y)`): without
            this, the lookup's `StopIteration` would end the epoch silently
            after zero steps. `keras.Model` raises `ValueError` here too.
    """
    for t in tree.flatten(x):
        if t is not None:
            return t
    raise ValueError(
        "`x` must hold at least one input tensor: the train step reads the "
        "batch size from the first input that is not None. Received: "
        f"x={x!r} (no tensor). Fix: pass the input data, e.g. "
        "`model.fit(x_train, y_train)` with `x_train` an array, or a "
        "list/dict of arrays with one per model input."
    )


def slice_sizes(n, slices):
    """The rows of each slice of a batch of `n` rows split `slices` ways:
    those of `numpy.array_split`, with no empty slice unless `n` is 0.

    Example:

    >>> slice_sizes(22, 3), slice_sizes(7, 4), slice_sizes(1, 2)
    ([8, 7, 7], [2, 2, 2, 1], [1])
    >>> [len(part) for part in np.array_split(np.arange(22), 3)]
    [8, 7, 7]
    """
    count = max(min(slices, n), 1)
    small, big = divmod(n, count)
    return [small + 1] * big + [small] * (count - big)


class Split(
    collections.namedtuple("Split", ["n", "count", "small", "big", "x", "y", "sample_weight"])
):
    """One batch and how it is split (`slice_sizes`, as int32 tensors):
    `count` slices, the first `big` of `small + 1` rows, the others of
    `small`; `x`, `y`, `sample_weight` the whole batch's structures
    (`None` where the batch has none)."""

    def start(self, i):
        """The first row of slice `i`."""
        return i * self.small + tf.minimum(i, self.big)

    def size(self, i):
        """The rows of slice `i`."""
        return self.small + tf.cast(i < self.big, tf.int32)

    def structures(self):
        return (self.x, self.y, self.sample_weight)


def split(x, y, sample_weight, slices):
    """The batch and its split (`slice_sizes`, traced)."""
    n = tf.shape(first_input(x))[0]
    count = tf.maximum(tf.minimum(n, slices), 1)
    return Split(n, count, n // count, n % count, x, y, sample_weight)


def _map(fn, structures):
    """`fn` over every tensor of the `(x, y, sample_weight)` structures."""
    return tuple(None if s is None else tree.map_structure(fn, s) for s in structures)


class Group(collections.namedtuple("Group", ["first", "end", "take"])):
    """Slices `first` to `end - 1`; `take(i)` gives slice `i`'s `(x, y,
    sample_weight, rows)`."""


def groups(batch):
    """The loops to run: outside XLA one over every slice (dynamic
    shapes); under XLA one per slice size, each slice of a static shape."""
    if not compat.in_xla_context():

        def take(i):
            start, size = batch.start(i), batch.size(i)
            parts = _map(lambda t: t[start : start + size], batch.structures())
            return (*parts, size)

        return [Group(tf.constant(0), batch.count, take)]
    groups = []
    for first, end, size in (
        (tf.constant(0), batch.big, batch.small + 1),
        (batch.big, batch.count, batch.small),
    ):
        groups.append(Group(first, end, _static_take(batch, first, end, size)))
    return groups


def _static_take(batch, first, end, size):
    """`take` for slices `first` to `end - 1`, all of `size` rows: the
    rows reshaped to `[end - first, size, ...]` before the loop. An empty
    group is given one slice of the batch's rows that the loop never
    reaches: XLA compiles the body for it, and indexing an empty axis
    does not compile."""
    count = tf.maximum(end - first, 1)
    rows = batch.start(first) + tf.range(count * size)
    rows = tf.minimum(rows, tf.maximum(batch.n - 1, 0))

    def grouped(t):
        t = tf.gather(tf.convert_to_tensor(t), rows)
        return tf.reshape(t, tf.concat([[count, size], tf.shape(t)[1:]], 0))

    parts = _map(grouped, batch.structures())

    def take(i):
        return (*_map(lambda t: t[i - first], parts), size)

    return take
