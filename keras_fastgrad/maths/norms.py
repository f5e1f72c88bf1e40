"""The global L2 norm without overflow, and the clip factor it gives.

Written once in `keras.ops` for both backends' steps (TensorFlow's
`keras_fastgrad.backend.tensorflow.clipping`, which passes its fused sum of squares in,
JAX's `keras_fastgrad.backend.jax.step`, through `step.update`'s `Shell`).
The gradients come in as dense float32 tensors (`None` entries and sparse
rows are the caller's: `step.gradients.summed_rows` on TensorFlow).

The sum of squares of finite float32 values can exceed float32's range (a
gradient of norm 2e20 squares to 4e40). Only then (a `cond` whose common
branch is one `sqrt`) is the sum recomputed on the gradient times 2**-80,
an exact power of two: the squares of finite float32 values then fit, and
values small enough to underflow weigh nothing against a norm above 2**64.
The norm is kept as `unit * root` (`unit` is 1, or 2**80 after a rescale),
so that `clip_norm / norm` is computed without overflow even where the norm
itself exceeds float32 (a norm that fits the clip only for `clip_norm`
above ~3.9; below, the factor divides by the product once: `fitted`).
"""

from typing import Any, NamedTuple

import keras  # noqa: F401  (the doctests')
import numpy as np
from keras import ops

# The overflow rescale: exact (a power of two); 2**-80 maps float32's
# largest value (~2**128) to 2**48, whose square times 2**31 elements fits.
RESCALE = 2.0**-80
# float32's smallest normal: a clip factor below it is flushed to 0 on CPUs.
_TINY = float(np.finfo(np.float32).tiny)
# float32's largest value: a bound above it is +inf in float32.
_MAX = float(np.finfo(np.float32).max)


def sum_squares(parts):
    """float32 scalar: the sum of squares of every element of `parts`
    (`keras.ops`; a shell may pass its own fused form to `scaled_norm`).

    Example:

    >>> float(sum_squares([keras.ops.array([3.0]), keras.ops.array([4.0])]))
    25.0
    """
    total = ops.sum(ops.square(parts[0]))
    for p in parts[1:]:
        total = total + ops.sum(ops.square(p))
    return total


def scaled_norm(parts, half_squares=None):
    """The global L2 norm of `parts` as `(unit, root)`, `norm = unit * root`.

    Args:
        parts: List of dense tensors (no `None`), measured in float32.
        half_squares: `None` (the squares summed by `sum_squares`), or a
            callable, a list of float32 tensors -> half their sum of
            squares (a float32 scalar): the TensorFlow shell passes its
            fused ops (`keras_fastgrad.backend.tensorflow.clipping`).

    Returns:
        Tuple of float32 scalars `(unit, root)`: `unit` is 1, or 2**80 when
        the squares overflow float32 (then `root` is the norm of the
        gradient times 2**-80). Finite whenever the gradients are. `(1, 0)`
        for no parts.

    Example:

    >>> unit, root = scaled_norm([keras.ops.array([3e20, 4e20])])
    >>> float(unit) == 2.0**80, float(unit * root)
    (True, 5.000000...e+20)
    """
    if not parts:
        return ops.convert_to_tensor(1.0), ops.convert_to_tensor(0.0)
    squares = sum_squares if half_squares is None else half_squares
    # Measured in float32 (a float16 gradient's squares overflow early);
    # no op for the float32 gradients the steps hand in.
    parts = [ops.cast(p, "float32") for p in parts]
    total = squares(parts)
    fits = ops.isfinite(total)
    # The rescale is a value, not a constant: XLA rewrites `square(p * c)`
    # for a constant `c` as `(p * p) * (c * c)`, whose `p * p` overflows
    # again and whose `c * c` (2**-160) is 0: a NaN norm (seen on JAX).
    shrink = ops.where(fits, 1.0, RESCALE)
    total = ops.cond(fits, lambda: total, lambda: squares([p * shrink for p in parts]))
    return 1.0 / shrink, ops.sqrt(total if half_squares is None else 2.0 * total)


def global_norm(parts):
    """float32 scalar: the global L2 norm of `parts` (`scaled_norm`'s
    `unit * root`), finite whenever the gradients are and the norm fits.

    Example:

    >>> float(global_norm([keras.ops.array([3.0]), keras.ops.array([4.0])]))
    5.0
    """
    unit, root = scaled_norm(parts)
    return unit * root


class Clipping(NamedTuple):
    """What `clip` gives for one update.

    Fields:
        factor: float32 scalar `min(1, clip_norm / norm)`, for the caller to
            multiply the gradients by (the JAX step inside its gated
            update, TensorFlow each gradient); NaN where not `checked` and
            the norm is beyond `fits_clip`.
        norm: float32 scalar, the norm `unit * root` (+inf where it
            exceeds float32's range; the `grad_norm` key).
        was_clipped: Boolean scalar, `norm > clip_norm`.
        ok: Boolean scalar, `fits_clip`: the update may be applied; `None`
            where it was not asked for.
    """

    factor: Any
    norm: Any
    was_clipped: Any
    ok: Any


def clip(clip_norm, parts=None, checked=False, fit=False, scaled=None):
    """The clip of an update to the global norm `clip_norm`: its factor,
    norm, whether it clips, whether it may be applied.

    Args:
        clip_norm: Python float > 0, or `None` (no clipping: `None` back).
        parts: List of dense tensors (no `None`), measured by
            `scaled_norm`; not read when `scaled` is given.
        checked: Python bool: the caller applies the factor only where the
            norm is finite and `fits_clip` (`ok`, or the verdict's check):
            no NaN guard in the factor.
        fit: Python bool: `ok` is `fits_clip` (else `None`: not asked).
        scaled: `(unit, root)` from `scaled_norm` (a shell's, with its
            fused sum), or `None` (measured here on `parts`).

    Returns:
        A `Clipping`, or `None` without `clip_norm`.

    Example:

    >>> c = clip(1.0, [keras.ops.array([3.0, 4.0])], fit=True)
    >>> float(c.factor), float(c.norm), bool(c.was_clipped), bool(c.ok)
    (0.2, 5.0, True, True)
    """
    if clip_norm is None:
        return None
    unit, root = scaled_norm(parts) if scaled is None else scaled
    norm = _product(unit, root)
    was_clipped = norm > clip_norm
    # Used only where the norm fits (`fits_clip`): where every such norm is
    # a finite float32, one division by it (the same value as by `unit`,
    # a power of two, then by `root`).
    if _finite_fit(clip_norm):
        quotient = clip_norm / norm
    else:
        quotient = (clip_norm / unit) / root
    factor = ops.where(was_clipped, quotient, 1.0)
    fits = _fits(clip_norm, unit, root, norm) if fit or not checked else None
    if not checked:  # `fits_clip`, on the norm computed here: NaN beyond
        factor = ops.where(fits, factor, float("nan"))
    return Clipping(factor, norm, was_clipped, fits if fit else None)


def clip_factor(clip_norm, unit, root, checked=False):
    """`min(1, clip_norm / norm)` for a norm given as `unit * root`
    (`clip`'s factor).

    Args:
        clip_norm: Python float > 0.
        unit: float32 scalar from `scaled_norm` (or the Python float 1).
        root: float32 scalar from `scaled_norm`.
        checked: Python bool: the caller uses the factor only where the norm
            is finite and `fits_clip` (then no op goes to the other case).

    Returns:
        Tuple `(factor, was_clipped)`: the float32 factor, finite for every
        finite gradient, and NaN (unless `checked`) for a non-finite norm or
        one beyond `fits_clip` (a factor the CPU would flush to 0: a
        silently zero update); the boolean `norm > clip_norm`.

    Example:

    >>> factor, was_clipped = clip_factor(1.0, 2.0**80, keras.ops.array(1e-4))
    >>> float(factor) > 0, bool(was_clipped)  # norm ~1.2e20, factor ~8e-21
    (True, True)
    """
    clipping = clip(clip_norm, checked=checked, scaled=(unit, root))
    return clipping.factor, clipping.was_clipped


def fits_clip(clip_norm, unit, root):
    """Boolean scalar: the update clipped by the norm `unit * root` may be
    applied: the norm finite and at most `clip_norm / tiny` (float32's smallest normal), so that
    the clip factor `clip_norm / norm` is a normal float. Beyond (a norm
    above ~1e38 for `clip_norm=1`) the factor would be subnormal, which
    CPUs flush to 0: a silently zero update, which the steps drop instead
    (counted). `unit`: a float32 scalar, or the Python float 1.

    Example:

    >>> bool(fits_clip(1.0, 1.0, keras.ops.array(1e37)))
    True
    >>> bool(fits_clip(1.0, 2.0**80, keras.ops.array(1e20)))  # ~1.2e44
    False
    >>> bool(fits_clip(1.0, 1.0, keras.ops.array(float("nan"))))
    False
    """
    return _fits(clip_norm, unit, root, _product(unit, root))


def fitted(clip_norm, unit, root):
    """`fits_clip` of a norm known finite, with that norm as the update it
    gates takes it (`clip`'s `scaled`): the norm computed once where the
    check and the clip both need it.

    Args:
        clip_norm: Python float > 0.
        unit: float32 scalar from `scaled_norm` (or the Python float 1).
        root: float32 scalar from `scaled_norm`, finite (the caller
            checked it).

    Returns:
        Tuple `(fits, scaled)`: `fits_clip(clip_norm, unit, root)`, and
        `(1.0, unit * root)` where every norm that fits is a finite
        float32 (`clip_norm / tiny` is: `clip_norm` up to ~3.9), else
        `(unit, root)`; to be clipped (`clip(scaled=...)`) only where
        `fits` holds.

    Example:

    >>> fits, (unit, norm) = fitted(1.0, 2.0**80, keras.ops.array(0.5))
    >>> bool(fits), unit, float(norm) == 2.0**79  # ~6e23 <= 1 / tiny
    (True, 1.0, True)
    """
    norm = _product(unit, root)
    fits = _fits(clip_norm, unit, root, norm)  # (`fits_clip`, the root known finite)
    return fits, ((1.0, norm) if _finite_fit(clip_norm) else (unit, root))


def _finite_fit(clip_norm):
    """Python bool: every norm that fits `clip_norm` (`fits_clip`) is a
    finite float32 (the bound `clip_norm / tiny` is)."""
    return clip_norm / _TINY < _MAX


def _product(unit, root):
    """`unit * root`, no op for the Python float 1."""
    return root if isinstance(unit, float) and unit == 1.0 else unit * root


def _fits(clip_norm, unit, root, norm):
    """Boolean scalar `unit * root <= clip_norm / tiny`. Where that bound
    is a finite float32 (`clip_norm` up to ~3.9), on the norm `norm`; else
    as `root * tiny <= clip_norm / unit`, both sides finite float32s: the
    bound itself, and a norm above float32's range, would be +inf (a
    finite gradient of norm 1e39 would pass `inf <= inf` and be applied
    with a factor flushed to 0). False for a NaN or infinite norm (`<=`
    fails): no separate finite check."""
    if _finite_fit(clip_norm):
        return norm <= clip_norm / _TINY
    return root * _TINY <= clip_norm / unit
