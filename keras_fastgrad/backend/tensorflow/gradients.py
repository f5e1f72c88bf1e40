"""Small operations on gradients that keep `tf.IndexedSlices` sparse.

An embedding lookup's gradient is a `tf.IndexedSlices` (the rows the batch
touched). Multiplying, casting or checking it as a dense tensor would
write the whole table each step; these helpers work on its rows.
"""

from keras_fastgrad._tf_startup import tf


def values(g):
    """The stored values of a gradient (its rows when sparse)."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def scale(g, factor):
    """`g * factor` in float32 (`None` stays `None`), sparse kept sparse."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, tf.float32) * factor, g.indices, g.dense_shape)
    return tf.cast(g, tf.float32) * factor


def to_float32(g):
    """`g` in float32, sparse kept sparse."""
    if g is None or g.dtype == tf.float32:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, tf.float32), g.indices, g.dense_shape)
    return tf.cast(g, tf.float32)


def to_float32_list(grads):
    """`to_float32` of each gradient in a list."""
    return [to_float32(g) for g in grads]


def summed_rows(g):
    """The values of `g` with duplicate rows added up (sparse: the rows of
    the dense gradient it stands for; what a norm must read)."""
    return summed_slices(g).values if isinstance(g, tf.IndexedSlices) else g


def summed_slices(g):
    """A `tf.IndexedSlices` with each row once (duplicates added up): the
    same dense gradient, with a row's values where its norm can be read.

    Example:

    >>> g = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([3, 3]),
    ...                      tf.constant([4, 1]))
    >>> s = summed_slices(g)
    >>> s.indices.numpy().tolist(), s.values.numpy().tolist()
    ([3], [[3.0]])
    """
    unique, position = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, position, tf.size(unique))
    return tf.IndexedSlices(values, unique, g.dense_shape)


def add(a, b):
    """Adds two gradient lists (`None` entries allowed), two
    `tf.IndexedSlices` kept sparse."""
    return [x if y is None else (y if x is None else _sum(x, y)) for x, y in zip(a, b)]


def _sum(x, y):
    if isinstance(x, tf.IndexedSlices) and isinstance(y, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([x.values, y.values], 0), tf.concat([x.indices, y.indices], 0), x.dense_shape
        )
    return tf.convert_to_tensor(x) + tf.convert_to_tensor(y)


def rows_gram(rows):
    """`rows rows^T`: one `MatMul` reading the stack twice (no transposed copy)."""
    return tf.matmul(rows, rows, transpose_b=True)
