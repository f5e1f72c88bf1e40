"""The loss's terms beyond the compiled output losses under
`accumulation_steps` and `micro_batches`: exact where the step can tell them
apart, refused (before any weight moves) where it cannot.

Terms: weight regularisers (`kernel_regularizer`: counted once per update by
the un-split step), activity regularisers (Keras divides them by the batch
size: per-row means) and the extra terms of an overridden `compute_loss`.
Reference: a plain `keras.Model` (or `keras.Sequential`) with the same
initial weights trained on the big batch (22 rows: `micro_batches=3` on
batches of 22, or `accumulation_steps=3` on batches of 8, 8 and 6).
"""

import keras
import numpy as np
import pytest

import keras_fastgrad

FG = keras_fastgrad.FastGradModel
N = 22
L2 = keras.regularizers.L2


# ------------------------------------------------------------------ models
def dense(cls, kernel=0.5, activity=0.1, **options):
    """An MLP with a weight and (optionally) an activity regulariser."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        3,
        activation="tanh",
        kernel_regularizer=L2(kernel),
        activity_regularizer=L2(activity) if activity else None,
    )(inputs)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def kernel_only(cls, **options):
    return dense(cls, activity=None, **options)


def sequential(cls, **options):
    keras.utils.set_random_seed(1)
    cls = keras_fastgrad.FastGradSequential if cls is FG else keras.Sequential
    return cls(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                5, activation="relu", kernel_regularizer=L2(0.2), activity_regularizer=L2(0.3)
            ),
            keras.layers.Dense(1),
        ],
        **options,
    )


def masked_rnn(cls, sequences=False, activity=True, **options):
    """Embedding(mask_zero=True) + GRU; `sequences`: a per-timestep loss
    under the mask (its normaliser counts valid timesteps, not rows)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(9, 4, mask_zero=True)(inputs)
    h = keras.layers.GRU(
        4,
        return_sequences=sequences,
        activity_regularizer=L2(0.2) if activity else None,
        kernel_regularizer=L2(0.1),
    )(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def masked_sequences(cls, **options):
    return masked_rnn(cls, sequences=True, **options)


def masked_sequences_weights_only(cls, **options):
    return masked_rnn(cls, sequences=True, activity=False, **options)


def conv(cls, **options):
    """A per-pixel loss (`[B, H, W]` elements), a kernel and an activity
    regulariser."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4, 4, 2))
    h = keras.layers.Conv2D(
        3,
        3,
        padding="same",
        activation="tanh",
        kernel_regularizer=L2(0.3),
        activity_regularizer=L2(0.1),
    )(inputs)
    return cls(inputs, keras.layers.Conv2D(1, 1)(h), **options)


def with_extra_term(base):
    class ExtraTerm(base):
        """`compute_loss` plus a per-row mean penalty on the predictions."""

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 0.5 * keras.ops.mean(keras.ops.square(y_pred))

    return ExtraTerm


def overridden(cls, **options):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, activation="tanh", kernel_regularizer=L2(0.5))(inputs)
    return with_extra_term(cls)(inputs, keras.layers.Dense(1)(h), **options)


def data_for(build, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.2, 2.0, N).astype("float32")
    if build is conv:
        x = rng.normal(size=(N, 4, 4, 2))
        return x.astype("float32"), rng.normal(size=(N, 4, 4, 1)).astype("float32"), weights
    if build in (masked_rnn, masked_sequences, masked_sequences_weights_only):
        lengths = rng.integers(1, 6, N)
        x = (rng.integers(1, 9, (N, 5)) * (np.arange(5) < lengths[:, None])).astype("int32")
        shape = (N, 5, 1) if build is not masked_rnn else (N, 1)
        return x, rng.normal(size=shape).astype("float32"), weights
    x = rng.normal(size=(N, 4)).astype("float32")
    return x, rng.normal(size=(N, 1)).astype("float32"), weights


# (options, batch size): one update per 22 rows either way
MICRO = ({"micro_batches": 3}, N)
ACCUMULATE = ({"accumulation_steps": 3}, 8)  # batches of 8, 8 and 6


def train(build, cls, reduction, options, batch_size, weighted):
    x, y, weights = data_for(build)
    model = build(cls, **options)
    model.compile(
        # (a summed loss's gradient grows with the rows: a smaller step)
        optimizer=keras.optimizers.SGD(0.005 if reduction == "sum" else 0.1),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
    )
    model.fit(
        x,
        y,
        sample_weight=weights if weighted else None,
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    return model


def max_diff(a, b):
    """The largest difference of the weights, relative to the largest weight
    where that is above 1."""
    scale = max(1.0, max(float(np.abs(p).max()) for p in a.get_weights()))
    return max(float(np.abs(p - q).max()) for p, q in zip(a.get_weights(), b.get_weights())) / scale


EXACT = [
    # (model, reduction, sample weights, split)
    (dense, "sum_over_batch_size", False, MICRO),
    (dense, "sum_over_batch_size", False, ACCUMULATE),
    (dense, "sum", False, MICRO),
    (dense, "sum", True, MICRO),
    (kernel_only, "sum", False, MICRO),
    (kernel_only, "mean_with_sample_weight", True, MICRO),
    (kernel_only, "mean_with_sample_weight", True, ACCUMULATE),
    (kernel_only, "sum_over_batch_size", True, ACCUMULATE),
    (sequential, "sum_over_batch_size", False, MICRO),
    (sequential, "sum_over_batch_size", False, ACCUMULATE),
    (sequential, "sum", False, MICRO),
    (masked_rnn, "sum_over_batch_size", False, MICRO),
    (masked_rnn, "sum_over_batch_size", False, ACCUMULATE),
    (masked_sequences_weights_only, "sum_over_batch_size", False, MICRO),
    (masked_sequences_weights_only, "sum_over_batch_size", False, ACCUMULATE),
    (masked_sequences, "sum", False, MICRO),
    (conv, "sum_over_batch_size", False, MICRO),
    (conv, "sum_over_batch_size", False, ACCUMULATE),
    (conv, "sum", False, MICRO),
    (overridden, "sum_over_batch_size", False, MICRO),
    (overridden, "sum_over_batch_size", False, ACCUMULATE),
]


def _id(case):
    build, reduction, weighted, (options, _) = case
    return f"{build.__name__}-{reduction}{'-weighted' if weighted else ''}-{next(iter(options))}"


# The fast tier's cases: each way of weighting a term once (the sweep over
# the others is in the full tier, tests/tiers.py).
FAST = [EXACT[i] for i in (1, 2, 6, 11, 14, 18)]
SWEEP = [case for case in EXACT if case not in FAST]


def _params(cases):
    return [pytest.param(case, id=_id(case)) for case in cases]


def check_exact(case):
    build, reduction, weighted, (options, batch_size) = case
    ref = train(build, keras.Model, reduction, {}, N, weighted)
    model = train(build, FG, reduction, options, batch_size, weighted)
    assert max_diff(ref, model) < 2e-5


@pytest.mark.parametrize("case", _params(FAST))
def test_terms_equal_the_big_batch(case):
    check_exact(case)


@pytest.mark.parametrize("case", _params(SWEEP))
def test_terms_equal_the_big_batch_sweep(case):
    check_exact(case)


REFUSED = [
    # (model, reduction, sample weights, split, what the message names)
    (dense, "sum", False, ACCUMULATE, r"reduction='sum'.*activity regulariser of layer"),
    (kernel_only, "sum", False, ACCUMULATE, r"weight regulariser of '.*kernel'"),
    (dense, "mean_with_sample_weight", True, MICRO, r"with sample weights.*activity regulariser"),
    (dense, "mean_with_sample_weight", True, ACCUMULATE, r"with sample weights"),
    (masked_sequences, "sum_over_batch_size", False, MICRO, r"with a mask.*activity regulariser"),
    (masked_sequences, "sum_over_batch_size", False, ACCUMULATE, r"with a mask"),
    (conv, "sum", False, ACCUMULATE, r"reduction='sum'"),
    (overridden, "sum", False, MICRO, r"ExtraTerm.compute_loss"),
    (overridden, "sum", False, ACCUMULATE, r"ExtraTerm.compute_loss"),
    (overridden, "mean_with_sample_weight", True, MICRO, r"ExtraTerm.compute_loss"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[_id(c[:4]) for c in REFUSED])
def test_inexact_terms_are_refused_before_any_update(case):
    build, reduction, weighted, (options, batch_size), names = case
    x, y, weights = data_for(build)
    model = build(FG, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
    )
    before = [w.copy() for w in model.get_weights()]
    option = "micro_batches=3" if "micro_batches" in options else "accumulation_steps=3"
    with pytest.raises(ValueError, match=rf"`{option}` cannot weight.*{names}.*Fix: .*sum_over"):
        model.fit(
            x,
            y,
            sample_weight=weights if weighted else None,
            batch_size=batch_size,
            shuffle=False,
            verbose=0,
        )
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
