"""The pseudo-inverse of a symmetric matrix in `keras.ops` (Keras 3.8 has
no `ops.pinv`), for the aggregators that need one (IMTL, ConFIG)."""

from keras import ops


def symmetric_pinv(matrix, rcond):
    """`matrix^+` of a symmetric `[T, T]` matrix, as `tf.linalg.pinv`.

    From the SVD `matrix = U S V^T`: `matrix^+ = V S^+ U^T`, where `S^+`
    inverts the singular values above `rcond * max(S)` and zeroes the
    others (`numpy.linalg.pinv(matrix, rcond)`'s cut; the others are set
    to `inf`, as `tf.linalg.pinv` does). Computed as `(U S^+ V^T)^T`,
    which is `V S^+ U^T` term for term. The SVD (unlike
    `eigh` on TensorFlow's CPU kernel) does not raise on a non-finite
    matrix: NaN in, NaN out.

    Args:
        matrix: `[T, T]` symmetric float tensor.
        rcond: scalar, the cut-off relative to the largest singular value.

    Returns:
        `[T, T]` tensor, the pseudo-inverse.

    Example:

    >>> m = np.array([[2.0, 0.0], [0.0, 0.0]])  # singular
    >>> keras.ops.convert_to_numpy(symmetric_pinv(m, 1e-6)).tolist()
    [[0.5, 0.0], [0.0, 0.0]]
    """
    u, s, vt = ops.svd(matrix, full_matrices=False)
    s = ops.where(s > rcond * ops.max(s), s, float("inf"))  # 1 / inf = 0
    return ops.transpose(ops.matmul(u / s[None, :], vt))
