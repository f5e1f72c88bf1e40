"""The gradient noise scale's estimators, written once in `keras.ops`.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162), App. A.1, for small batches of uneven sizes (the
derivation and the unit's rules: `keras_fastgrad.step.noise_scale`), on
explicit values; each backend's shell keeps the results where its state
lives (variables on TensorFlow, Keras' state tuple on JAX).

A window's measures are five sums over its small batches `i` (rows `n_i`,
loss normaliser `D_i`): `[sum |g_i|^2, sum 1/n_i, k, sum D_i^2/n_i,
sum D_i]`, the first three over the `k` measured ones, the last two over
all of them.
"""

from keras import ops

MEASURES = 5  # sum |g_i|^2, sum 1/n_i, k, sum D_i^2/n_i, sum D_i


def small_batch(squared_norm, rows, normaliser):
    """One small batch's measures, `[|g|^2, 1/n, 1, D^2/n, D]` (zeros for a
    batch without rows or with a zero normaliser: left out).

    Args:
        squared_norm: float32 scalar, `|D g|^2`: the squared norm of its
            gradient as the step weights it (times `normaliser`); `None`:
            not measured (only its weight enters, `[0, 0, 0, D^2/n, D]`
            after the caller's mask).
        rows: float32 scalar, its number of rows `n`.
        normaliser: float32 scalar, its loss normaliser `D`.

    Returns:
        float32 tensor of shape `(5,)`.

    Example:

    >>> m = small_batch(keras.ops.array(100.0), keras.ops.array(4.0), keras.ops.array(2.0))
    >>> [float(v) for v in m]  # |(6, 8) / 2|^2, 1/4, 1, 2^2/4, 2
    [25.0, 0.25, 1.0, 1.0, 2.0]
    """
    present = (rows > 0.0) & (normaliser > 0.0)
    safe_rows = ops.where(present, rows, 1.0)
    safe_d = ops.where(present, normaliser, 1.0)
    d_squared = ops.square(safe_d)
    measured = ops.convert_to_tensor(0.0) if squared_norm is None else squared_norm / d_squared
    measures = ops.stack(
        [measured, 1.0 / safe_rows, ops.convert_to_tensor(1.0), d_squared / safe_rows, safe_d]
    )
    return ops.where(present, measures, ops.zeros_like(measures))


def estimate(small_sq_mean, big_sq, s, t):
    """The unbiased `(|G|^2, tr(Sigma))`: `s` is `mean_i 1/n_i` over the
    measured small batches, `t` what `1/B_big` stands for
    (`sum_i a_i^2 / n_i`, `a_i = D_i / sum_j D_j`).

    Example (the paper's equal batches: B_small 8, B_big 32; true |G|^2 = 1,
    tr(Sigma) = 16 give E|G_small|^2 = 3, E|G_big|^2 = 1.5):

    >>> g2, trace = estimate(3.0, 1.5, 1 / 8, 1 / 32)
    >>> float(g2), float(trace)
    (1.0, 16.0)
    """
    gap = s - t
    grad_sq = (s * big_sq - t * small_sq_mean) / gap
    trace = (small_sq_mean - big_sq) / gap
    return grad_sq, trace


def window_estimate(window, big_sq):
    """The window's `(|G|^2, tr(Sigma), valid)` from its measures and the
    squared norm of its (unscaled, unclipped) gradient. Not `valid` (the
    moving averages are left as they are): no measured small batch, less
    than two small batches' worth of spread (`s <= t`), or a non-finite
    estimate.

    Args:
        window: float32 tensor `(5,)`, the summed `small_batch` measures.
        big_sq: float32 scalar, `|G_big|^2`.

    Example (two small batches of 2 rows, `|g|^2` 2 and 4, `D` 2 each;
    `|G_big|^2` 2.5: `s = 1/2`, `t = 1/4`):

    >>> w = keras.ops.array([6.0, 1.0, 2.0, 4.0, 4.0])
    >>> [float(v) for v in window_estimate(w, keras.ops.array(2.5))]
    [2.0, 2.0, 1.0]
    """
    small_sq, inv_rows, count, weight_sq, weight = ops.unstack(window)
    safe_count = ops.maximum(count, 1.0)
    s = inv_rows / safe_count
    t = ops.divide_no_nan(weight_sq, ops.square(weight))
    grad_sq, trace = estimate(small_sq / safe_count, big_sq, s, t)
    valid = (count >= 1.0) & (s > t * (1.0 + 1e-6))
    valid = valid & ops.isfinite(grad_sq) & ops.isfinite(trace)
    return grad_sq, trace, valid


def moving_averages(emas, decay, grad_sq, trace, valid):
    """The EMAs `(ema_grad_sq, ema_trace, ema_weight)` after one window
    (unchanged unless `valid`); `ema_weight = 1 - decay^windows` is their
    bias (`logs` divides by it).

    Example:

    >>> zero = keras.ops.array(0.0)
    >>> emas = moving_averages((zero, zero, zero), 0.5, 4.0, 8.0, keras.ops.array(True))
    >>> [float(v) for v in emas]
    [2.0, 4.0, 0.5]
    """
    ema_grad_sq, ema_trace, ema_weight = emas
    keep = 1.0 - decay
    return (
        ops.where(valid, decay * ema_grad_sq + keep * grad_sq, ema_grad_sq),
        ops.where(valid, decay * ema_trace + keep * trace, ema_trace),
        ops.where(valid, decay * ema_weight + keep, ema_weight),
    )


def logs(ema_grad_sq, ema_trace, ema_weight):
    """`(B_simple, |G|^2, tr(Sigma))`: the bias-corrected EMAs and their
    ratio; NaN before the first estimate (`ema_weight` 0).

    Example:

    >>> [float(v) for v in logs(2.0, 4.0, keras.ops.array(0.5))]
    [2.0, 4.0, 8.0]
    """
    measured = ema_weight > 0.0
    nan = float("nan")
    grad_sq = ops.where(measured, ema_grad_sq / ema_weight, nan)
    trace = ops.where(measured, ema_trace / ema_weight, nan)
    return trace / grad_sq, grad_sq, trace
