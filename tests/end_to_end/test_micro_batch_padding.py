"""`micro_batches` on batches that do not divide evenly: no row reaches the
model twice (issue 27, case 2).

The old split padded the last slice with copies of real rows and masked
them out of the compiled loss only: activity regularisers, `add_loss`
terms, the extra terms of an overridden `compute_loss` and BatchNorm's
moments saw them. Reference: a plain `keras.Model` (or `keras.Sequential`)
with the same initial weights, trained on the same, un-split batches; for
BatchNorm (each slice normalised by its own moments), the same model
called on each slice of `numpy.array_split` and one SGD step on the whole
batch's loss, its gradient taken by the tests' backend-neutral
reference (`helpers.reference_gradients`).
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import reference_gradients

FG = keras_fastgrad.FastGradModel


# ------------------------------------------------------------------ models
def activity(cls, **options):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(6, activation="tanh", activity_regularizer=keras.regularizers.L2(0.3))(
        inputs
    )
    return cls(inputs, keras.layers.Dense(1)(h), **options)


class AddsLoss(keras.layers.Layer):
    """Adds the mean square of its inputs (a per-sample mean) as a loss."""

    def call(self, inputs):
        self.add_loss(0.2 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def add_loss(cls, **options):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    h = AddsLoss()(keras.layers.Dense(6, activation="tanh")(inputs))
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def with_extra_term(base):
    class ExtraTerm(base):
        """`compute_loss` plus a penalty on the predictions' mean square."""

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 0.5 * keras.ops.mean(keras.ops.square(y_pred))

    return ExtraTerm


def compute_loss(cls, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    return with_extra_term(cls)(inputs, keras.layers.Dense(1)(h), **options)


def sequential(cls, **options):
    keras.utils.set_random_seed(4)
    cls = keras_fastgrad.FastGradSequential if cls is FG else keras.Sequential
    return cls(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                6, activation="relu", activity_regularizer=keras.regularizers.L1(0.1)
            ),
            keras.layers.Dense(1),
        ],
        **options,
    )


def conv(cls, **options):
    """Per-pixel loss (`[B, H, W]` elements) and an activity regulariser."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4, 4, 2))
    h = keras.layers.Conv2D(
        3, 3, padding="same", activation="tanh", activity_regularizer=keras.regularizers.L2(0.1)
    )(inputs)
    return cls(inputs, keras.layers.Conv2D(1, 1)(h), **options)


def masked_rnn(cls, **options):
    """Per-timestep loss under an `Embedding(mask_zero=True)` mask."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(9, 4, mask_zero=True)(inputs)
    h = keras.layers.GRU(4, return_sequences=True)(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def data_for(build, n, seed=0):
    rng = np.random.default_rng(seed)
    if build is conv:
        return rng.normal(size=(n, 4, 4, 2)).astype("float32"), rng.normal(
            size=(n, 4, 4, 1)
        ).astype("float32")
    if build is masked_rnn:
        lengths = rng.integers(1, 6, n)
        x = rng.integers(1, 9, (n, 5)) * (np.arange(5) < lengths[:, None])
        return x.astype("int32"), rng.normal(size=(n, 5, 1)).astype("float32")
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def max_diff(a, b):
    return max(float(np.abs(p - q).max()) for p, q in zip(a.get_weights(), b.get_weights()))


def train(build, cls, n, batch_size, options=None, compile_kwargs=None, epochs=2):
    x, y = data_for(build, n)
    model = build(cls, **(options or {}))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2), loss="mse", metrics=["mae"], **(compile_kwargs or {})
    )
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


MODELS = [activity, add_loss, compute_loss, sequential, conv, masked_rnn]
# (rows, slices): a batch of `rows` in `slices` slices; 1 row in 2 slices
# (fewer rows than slices: one slice) is the last batch of 3 rows in 2s.
SPLITS = [(22, 3), (7, 4), (2, 2), (24, 3)]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"{s[0]}rows_{s[1]}slices")
@pytest.mark.parametrize("build", MODELS, ids=lambda b: b.__name__)
def test_every_term_equals_the_unsplit_step(build, split):
    rows, slices = split
    n = 3 if rows == 2 else rows  # 2 then 1 row for the (2, 2) case
    ref, h_ref = train(build, keras.Model, n, rows)
    model, h = train(build, FG, n, rows, {"micro_batches": slices})
    assert max_diff(ref, model) < 2e-6
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=2e-5)
    np.testing.assert_allclose(h["mae"], h_ref["mae"], rtol=2e-5)


@pytest.mark.parametrize("build", [activity, add_loss, compute_loss, masked_rnn])
@pytest.mark.parametrize(
    "compile_kwargs",
    [{"jit_compile": True}, {"steps_per_execution": 2}],
    ids=["xla", "steps_per_execution"],
)
def test_xla_and_steps_per_execution(build, compile_kwargs):
    # Batches of 7 (uneven in 4 slices: 2, 2, 2, 1) and a last one of 3.
    ref, h_ref = train(build, keras.Model, 17, 7, compile_kwargs=compile_kwargs)
    model, h = train(build, FG, 17, 7, {"micro_batches": 4}, compile_kwargs)
    assert max_diff(ref, model) < 2e-6
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=2e-5)


def test_with_accumulation():
    # Windows of two batches of 11, each in 3 slices (4, 4, 3): the big
    # batch of 22.
    ref, _ = train(activity, keras.Model, 44, 22)
    model, _ = train(activity, FG, 44, 11, {"micro_batches": 3, "accumulation_steps": 2})
    assert max_diff(ref, model) < 2e-6


# --------------------------------------------------------------- BatchNorm
def batchnorm(cls, **options):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Activation("tanh")(h)), **options)


def ghost_batchnorm_step(x, y, slices, lr):
    """One SGD step of a plain model whose forward pass is `numpy.array_split`'s
    slices, each normalised by its own moments; the loss is the whole
    batch's. Returns the model, the loss and the slices' moments."""
    ref = batchnorm(keras.Model)
    ref.compile(loss="mse")
    bn = next(la for la in ref.layers if isinstance(la, keras.layers.BatchNormalization))
    moving = [bn.moving_mean.numpy(), bn.moving_variance.numpy()]

    def loss_fn():
        preds = [ref(part, training=True) for part in np.array_split(x, slices)]
        return ref.compute_loss(x, y, keras.ops.concatenate(preds, 0))

    loss, grads = reference_gradients(ref, loss_fn)  # (either backend)
    for v, g in zip(ref.trainable_variables, grads):
        v.assign(v.numpy() - lr * g)
    bn.moving_mean.assign(moving[0])  # put back what the calls moved (TensorFlow)
    bn.moving_variance.assign(moving[1])
    return ref, loss


@pytest.mark.parametrize("rows, slices", [(22, 3), (7, 4), (1, 2), (24, 3)])
def test_batchnorm_normalises_each_slice_by_its_real_rows(rows, slices):
    x, y = data_for(batchnorm, rows, seed=4)
    ref, ref_loss = ghost_batchnorm_step(x, y, slices, lr=0.2)
    model = batchnorm(FG, micro_batches=slices)
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    logs = model.train_on_batch(x, y, return_dict=True)
    trainable = [v.numpy() for v in model.trainable_variables]
    assert (
        max(float(np.abs(a - b.numpy()).max()) for a, b in zip(trainable, ref.trainable_variables))
        < 2e-6
    )
    np.testing.assert_allclose(logs["loss"], ref_loss, rtol=2e-5)
    # The moving statistics: one step from the whole batch's moments.
    bn = next(la for la in model.layers if isinstance(la, keras.layers.BatchNormalization))
    start = batchnorm(keras.Model)
    features = keras.ops.convert_to_numpy(start.layers[1](x))
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * features.mean(0), atol=1e-6)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), 0.5 + 0.5 * features.var(0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rows, slices", [(22, 3), (7, 4)])
def test_batchnorm_micro_batch_statistics_move_per_real_slice(rows, slices):
    # `batchnorm_statistics="micro_batch"`: one momentum step per slice,
    # from that slice's rows (numpy reference).
    x, y = data_for(batchnorm, rows, seed=5)
    model = batchnorm(FG, micro_batches=slices, batchnorm_statistics="micro_batch")
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    features = keras.ops.convert_to_numpy(batchnorm(keras.Model).layers[1](x))
    model.train_on_batch(x, y)
    mean, var = np.zeros(4), np.ones(4)
    for part in np.array_split(features, slices):
        mean, var = 0.5 * mean + 0.5 * part.mean(0), 0.5 * var + 0.5 * part.var(0)
    bn = next(la for la in model.layers if isinstance(la, keras.layers.BatchNormalization))
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)
