"""FastGradModel as a drop-in for `keras.Model`: an optimizer's own
`loss_scale_factor`, an `x` with no tensor, and `keras.models.clone_model`.
References are plain `keras.Model`s trained the same way, or values worked
out with a tape."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import (
    data,
    fast,
    max_weight_diff,
    mlp,
    same_start,
    tf,  # (TensorFlow imported at first use: not on JAX)
)

FACTOR = 64.0  # a power of two: scaling and unscaling are exact in float32


def optimizer(name, **kwargs):
    if name == "sgd":
        return keras.optimizers.SGD(0.1, **kwargs)
    return keras.optimizers.Adam(0.01, **kwargs)


# ------------------------------------------------------- loss_scale_factor
@pytest.mark.tensorflow_only(
    reason="a fixed loss_scale_factor is refused on JAX (tests/models/test_refusals_jax.py)"
)
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_loss_scale_factor_trains_like_keras_model(name):
    x, y = data(n=12)
    ref, model = mlp(), fast()
    same_start(ref, model)
    ref.compile(optimizer=optimizer(name, loss_scale_factor=FACTOR), loss="mse")
    model.compile(optimizer=optimizer(name, loss_scale_factor=FACTOR), loss="mse")
    h_ref = ref.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-6)
    # The optimizer keeps its factor (saved with it, used by `scale_loss`).
    assert model.optimizer.loss_scale_factor == FACTOR


@pytest.mark.tensorflow_only(
    reason="a fixed loss_scale_factor is refused on JAX (tests/models/test_refusals_jax.py)"
)
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_loss_scale_factor_with_accumulation_and_clipping(name):
    # 12 samples, batches of 4, windows of 2: one full window and a partial
    # one, which equal `keras.Model` on batches of 8 and 4. Keras clips
    # after its optimizer divides by the factor: the true gradient.
    x, y = data(n=12)
    ref = mlp()
    model = fast(accumulation_steps=2, clip_norm=0.05, telemetry=True)
    same_start(ref, model)
    ref.compile(
        optimizer=optimizer(name, loss_scale_factor=FACTOR, global_clipnorm=0.05),
        loss="mse",
    )
    model.compile(optimizer=optimizer(name, loss_scale_factor=FACTOR), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert h.history["clipped_updates"][-1] == 4  # clipping was active
    assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.tensorflow_only(
    reason="a fixed loss_scale_factor is refused on JAX (tests/models/test_refusals_jax.py)"
)
def test_loss_scale_factor_grad_norm_is_the_true_gradient_norm():
    # One update (8 samples, batches of 4, windows of 2): `grad_norm` is the
    # norm of the unscaled gradient of the 8-sample loss at the start.
    x, y = data(n=8)
    ref, model = mlp(), fast(accumulation_steps=2, clip_norm=1e6, telemetry=True)
    same_start(ref, model)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, ref(x))
    grads = tape.gradient(loss, [v.value for v in ref.trainable_variables])
    expected = float(tf.linalg.global_norm(grads))
    model.compile(optimizer=optimizer("sgd", loss_scale_factor=FACTOR), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["grad_norm"][-1], expected, rtol=1e-5)
    assert h.history["clipped_updates"][-1] == 0
    assert h.history["loss_scale"][-1] == FACTOR


# ------------------------------------------------------------- x: no tensor
def test_fit_with_no_input_tensor_raises_value_error():
    # The error `keras.Model` raises (its input is not optional), not a
    # silent epoch of zero steps.
    x, y = data(n=8)
    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    with pytest.raises(Exception) as expected:  # what `keras.Model` raises
        ref.fit([None], y, epochs=1, verbose=0)
    model = fast()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(type(expected.value)) as raised:
        model.fit([None], y, epochs=1, verbose=0)
    if isinstance(expected.value, ValueError):  # (Keras < 3.10: its data
        # adapter fails first, before any train step)
        assert "is not optional, but None was passed" in str(expected.value)
        assert "is not optional, but None was passed" in str(raised.value)
    assert int(model.optimizer.iterations.numpy()) == 0


class IgnoresItsInput(keras_fastgrad.FastGradModel):
    def __init__(self):
        super().__init__()
        self.bias = keras.layers.Dense(1)

    def call(self, x):
        return self.bias(keras.ops.ones([2, 1]))


@pytest.mark.skipif(
    tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 10),
    reason="Keras < 3.10 fails in its data adapter first (an AttributeError)",
)
def test_fit_with_no_input_tensor_our_error_where_keras_has_none():
    model = IgnoresItsInput()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(ValueError, match=r"`x` must hold at least one input tensor.*Fix:"):
        model.train_on_batch([None], np.ones((2, 1)))


# ---------------------------------------------------------- clone_model
class CustomFastGrad(keras_fastgrad.FastGradModel):
    """A user subclass used in the functional form."""


OPTION_SETS = [
    dict(
        accumulation_steps=3,
        clip_norm=0.5,
        skip_nonfinite=False,
        telemetry=True,
        micro_batches=2,
        max_consecutive_nonfinite=None,
    ),
    dict(accumulation_steps=2, multitask="pcgrad", max_consecutive_nonfinite=4),
]


@pytest.mark.parametrize("cls", [keras_fastgrad.FastGradModel, CustomFastGrad])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_clone_model_keeps_every_option(cls, options):
    model = mlp(cls, **options)
    clone = keras.models.clone_model(model)
    assert clone is not model and isinstance(clone, cls)
    expected = dict(
        accumulation_steps=1,
        clip_norm=None,
        skip_nonfinite=True,
        telemetry=False,
        micro_batches=1,
        max_consecutive_nonfinite=10,
    )
    expected.update({k: v for k, v in options.items() if k != "multitask"})
    for key, value in expected.items():
        assert getattr(clone, key) == value, key
    if "multitask" in options:
        assert type(clone.multitask) is type(model.multitask)
        assert clone.multitask is not model.multitask  # not shared state
        assert type(clone.multitask).__name__ == "PCGrad"
    else:
        assert clone.multitask is None


def test_clone_trains_like_the_original_with_accumulation():
    # 10 samples, batches of 3, windows of 2: a short last window.
    x, y = data(n=10)
    model = fast(accumulation_steps=2, clip_norm=0.1)
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    ref = mlp()  # keras.Model on the windows' concatenated batches
    same_start(ref, model)
    for m in (model, clone):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.1), loss="mse")
    ref.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(model, clone) == 0.0
    assert max_weight_diff(ref, clone) < 1e-6
    assert int(clone.optimizer.iterations.numpy()) == 4
