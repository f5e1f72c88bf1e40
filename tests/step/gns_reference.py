"""A numpy reference for the gradient noise scale, independent of the step.

Gradients come from a plain `keras.Model` (the same weights) on each small
batch and on the whole window (the concatenation, not a weighted sum of the
small batches' gradients); the estimators are the paper's equations
(McCandlish et al. 2018, App. A.1), transcribed:

    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

with `|G_small|^2` the mean of the measured small batches' squared norms
(with `micro_batches`, the step measures the first slice of each batch). For small
batches of different sizes, `B_small` is their harmonic mean (what makes
`E[mean_i |g_i|^2] = |G|^2 + tr(Sigma) / B_small` hold). Then EMAs of both,
with Adam's bias correction, and `B_simple = EMA(S) / EMA(|G|^2)`.
"""

import numpy as np

from tests.helpers import reference_gradients


def squared_gradient_norm(model, loss_fn, x, y):
    """`|grad of the mean loss on (x, y)|^2` of a plain Keras model (float64;
    `helpers.reference_gradients`: any Keras backend)."""

    def loss():
        value = loss_fn(y, model(x, training=True))
        return value + sum(model.losses) if model.losses else value

    _, grads = reference_gradients(model, loss)
    return sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in grads)


def paper_estimates(small_sq, small_sizes, big_sq, big_size):
    """The paper's `(|G|^2, S)` for one window."""
    g_small = float(np.mean(small_sq))
    b_small = 1.0 / float(np.mean(1.0 / np.asarray(small_sizes, np.float64)))
    b_big = float(big_size)
    grad_sq = (b_big * big_sq - b_small * g_small) / (b_big - b_small)
    trace = (g_small - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


def noise_scale(model, loss_fn, windows, decay, measured=None):
    """`(B_simple, |G|^2, tr(Sigma))` after the windows, each a list of
    small batches `(x, y)`; the weights stay fixed (learning rate 0).
    `measured(j)`: whether the window's `j`-th small batch enters
    `|G_small|^2` (all by default; every one is in the big batch)."""
    ema_g = ema_s = weight = 0.0
    for window in windows:
        chosen = [b for j, b in enumerate(window) if measured is None or measured(j)]
        small_sq = [squared_gradient_norm(model, loss_fn, x, y) for x, y in chosen]
        sizes = [len(x) for x, _ in chosen]
        big_x = np.concatenate([x for x, _ in window])
        big_y = np.concatenate([y for _, y in window])
        big_sq = squared_gradient_norm(model, loss_fn, big_x, big_y)
        grad_sq, trace = paper_estimates(small_sq, sizes, big_sq, len(big_x))
        ema_g = decay * ema_g + (1 - decay) * grad_sq
        ema_s = decay * ema_s + (1 - decay) * trace
        weight = decay * weight + (1 - decay)
    return ema_s / ema_g, ema_g / weight, ema_s / weight


def split(x, y, sizes):
    """`(x, y)` as consecutive small batches of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out
