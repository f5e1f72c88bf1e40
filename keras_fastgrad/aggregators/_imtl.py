"""IMTL-G (Liu et al., ICLR 2021): equal projections of the merged
gradient on every task's unit gradient."""

from keras import ops

from keras_fastgrad.aggregators._base import Aggregator, _register
from keras_fastgrad.aggregators._utils.linalg import symmetric_pinv
from keras_fastgrad.aggregators._utils.numerics import _compiled, _dtype, _eps, _max_diag


@_register
class IMTL(Aggregator):
    """IMTL-G (Liu et al., ICLR 2021), generalised as torchjd's `IMTLG`.

    "Towards Impartial Multi-task Learning": the merged gradient
    `g = sum_t w_t g_t`, `sum_t w_t = 1`, has equal projections on every
    unit task gradient `u_t = g_t / ||g_t||`. In Gram space
    `G w = c d` with `d = sqrt(diag G)` the gradient norms, so
    `w = G^+ d / sum(G^+ d)`: at full rank exactly the paper's closed form,
    and with the pseudo-inverse `(.)^+` (cut-off `T eps(dtype)` relative, as
    numpy) the generalisation of Quinton & Rey, "Jacobian Descent for
    Multi-Objective Optimization" (2024) to dependent gradients. A task
    whose gradient is zero gets weight 0 and the others are balanced among
    themselves; if `sum(G^+ d)` vanishes (e.g. `G = 0`) every weight is 0.

    Example:

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> keras.ops.convert_to_numpy(IMTL().weights(gram)).round(4).tolist()
    [0.3333, 0.6667]
    >>> zero_task = np.array([[4.0, 0.0], [0.0, 0.0]])  # task 2: no gradient
    >>> keras.ops.convert_to_numpy(IMTL().weights(zero_task)).tolist()
    [1.0, 0.0]
    """

    name = "imtl"

    def _weights(self, gram):
        return imtl_weights(gram)


@_compiled()
def imtl_weights(gram):
    """IMTL-G (Liu et al., 2021) from the Gram matrix, zero gradients allowed.

    The merged gradient `g = sum_t w_t g_t` (`sum_t w_t = 1`) has equal
    projections `<g, u_t> = c` on every unit gradient `u_t = g_t / ||g_t||`:
    `(G w)_t = c ||g_t||`, i.e. `w = G^+ d / sum(G^+ d)` with
    `d = sqrt(diag G)` the gradient norms. At full rank this is the paper's
    closed form (`alpha_{2:T} = g_1 U^T (D U^T)^{-1}`,
    `alpha_1 = 1 - sum(alpha_{2:T})`) rewritten in `G`; with the
    pseudo-inverse `(.)^+` it is torchjd's generalisation (`IMTLGWeighting`)
    to linearly dependent gradients. A task with a zero gradient has a zero
    row in `G` and `d_t = 0`: it gets weight 0 and the other tasks are
    balanced among themselves (the paper's form would put all the weight on
    it and return a zero update). Singular values up to `T eps(dtype)` times
    the largest are cut, as `numpy.linalg.pinv(rtol=None)`. When
    `sum(G^+ d)` is zero at rounding level (e.g. `G = 0`) the weights are 0,
    as torchjd. A non-finite `G` gives non-finite weights.

    Decision: `G` is divided by `max(diag G)` first. The weights do not
    depend on `G`'s scale, but XLA's SVD (behind `pinv`) has absolute
    tolerances: without this a Gram scaled by `1e-6` was 0.3 off under
    `jit_compile=True`, and float32 entries near `1e30` gave NaN.
    """
    gram = ops.convert_to_tensor(gram)
    num_tasks, dtype = gram.shape[0], _dtype(gram.dtype)
    gram = gram / _max_diag(gram)  # scale-free weights; XLA's SVD is not
    norms = ops.expand_dims(ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0)), 1)  # a column
    pinv = symmetric_pinv(gram, num_tasks * _eps(dtype))
    v = ops.matmul(pinv, norms)
    # Refinement steps: XLA's SVD stops near 1e-7 relative, even in float64.
    for _ in range(2):
        v = v + ops.matmul(pinv, norms - ops.matmul(gram, v))
    v = ops.squeeze(v, 1)
    total = ops.sum(v)
    degenerate = ops.abs(total) <= num_tasks * _eps(dtype) * ops.sum(ops.abs(v))
    return ops.where(degenerate, 0.0, v / ops.where(degenerate, 1.0, total))
