"""The paths where the step makes no finite check of its own (issue 28).

- `skip_nonfinite=False` without loss scaling: "applies such gradients
  like `keras.Model` does" (the option's docstring, docs/concepts/safety.md).
  With `clip_norm`, under accumulation and `micro_batches` too, a NaN or
  an Inf micro-batch reaches the weights as through `keras.Model` with
  `global_clipnorm` (a non-finite norm makes every gradient NaN): the
  NaN-ness of every weight is compared, not the values.
- Loss scaling (`mixed_float16`) still drops such a micro-batch: the
  weights equal `keras.Model` trained on the data without it.
- `clip_adaptive`: a non-finite gradient never reaches the weights
  (docs/concepts/adaptive-clipping.md), with either `skip_nonfinite`:
  the weights equal a plain loop on the finite batches with numpy AGC
  (`helpers.np_agc`).
- The no-`cond` path (`skip_nonfinite=False`) on the models beyond an MLP,
  with and without accumulation: exact against `keras.Model` on the
  equivalent big batch.
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.end_to_end.test_exactness import _clip_case, embedding_model, relative_error
from tests.end_to_end.test_extra_loss_terms import masked_sequences_weights_only
from tests.helpers import mlp, np_agc, reference_gradients

FG = keras_fastgrad.FastGradModel
CLIP = 0.1


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def linear(cls, **options):
    """`Dense(2)` on 3 features: a target NaN (or a linear loss's Inf) in
    one output column leaves the other column's gradient finite, so a
    step that clipped without its NaN guard would apply a partly finite
    update where Keras' `global_clipnorm` makes every gradient NaN."""
    keras.utils.set_random_seed(21)
    inputs = keras.Input((3,))
    return cls(inputs, keras.layers.Dense(2)(inputs), **options)


def linear_loss(y_true, y_pred):
    """Linear in the prediction: an Inf target gives an Inf gradient."""
    return keras.ops.mean(y_true * y_pred, axis=-1)


def bad_data(bad, n=12, row=5):
    """12 rows (3 batches of 4), output column 1 of `row` (batch 1) NaN
    or Inf; the loss for which that makes the gradient NaN or Inf."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    y[row, 1] = np.nan if bad == "nan" else np.inf
    return x, y, ("mse" if bad == "nan" else linear_loss)


def nonfinite_pattern(model):
    return [(np.isnan(w), np.isinf(w)) for w in model.get_weights()]


def assert_same_pattern(ref, model):
    for (nan_r, inf_r), (nan_m, inf_m) in zip(nonfinite_pattern(ref), nonfinite_pattern(model)):
        np.testing.assert_array_equal(nan_m, nan_r)
        np.testing.assert_array_equal(inf_m, inf_r)


# ------------------------------- clip_norm + skip_nonfinite=False: applied
# (bad, options, the reference's batch size, micro-batches counted)
PLAIN = ({}, 4, 2)  # the bad batch, then the next one on NaN weights
WINDOW = ({"accumulation_steps": 3}, 12, 1)  # one window: the weights move at its end
SLICED = ({"micro_batches": 2}, 4, 2)
CLIP_CASES = [("nan", *PLAIN), ("inf", *WINDOW), ("nan", *SLICED)]
CLIP_SWEEP = [("inf", *PLAIN), ("nan", *WINDOW), ("inf", *SLICED)]


def _clip_applies_like_keras(bad, options, ref_batch, counted):
    x, y, loss = bad_data(bad)
    ref = linear(keras.Model)
    model = linear(FG, clip_norm=CLIP, skip_nonfinite=False, telemetry=True, **options)
    ref.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=CLIP), loss=loss)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    ref.fit(x, y, batch_size=ref_batch, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # Keras' clipping makes every gradient NaN: every weight is NaN.
    assert all(np.isnan(w).all() for w in ref.get_weights())
    assert_same_pattern(ref, model)
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    # Counted (a `nonfinite_*` key is requested), each micro-batch once.
    assert h.history["nonfinite_count"] == [float(counted)]


@pytest.mark.parametrize("bad, options, ref_batch, counted", CLIP_CASES)
def test_clip_norm_applies_a_nonfinite_batch_like_keras(bad, options, ref_batch, counted):
    _clip_applies_like_keras(bad, options, ref_batch, counted)


@pytest.mark.parametrize("bad, options, ref_batch, counted", CLIP_SWEEP)
def test_clip_norm_applies_a_nonfinite_batch_like_keras_sweep(bad, options, ref_batch, counted):
    _clip_applies_like_keras(bad, options, ref_batch, counted)


def test_without_clipping_an_accumulated_nan_reaches_only_its_weights():
    # No clipping: NaN only where the gradient is NaN (column 1), as
    # keras.Model on the window's big batch.
    x, y, loss = bad_data("nan")
    ref, model = linear(keras.Model), linear(FG, skip_nonfinite=False, accumulation_steps=3)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    ref.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    kernel = ref.get_weights()[0]
    assert np.isnan(kernel[:, 1]).all() and np.isfinite(kernel[:, 0]).all()
    assert_same_pattern(ref, model)
    np.testing.assert_allclose(model.get_weights()[0][:, 0], kernel[:, 0], rtol=1e-5)


def test_a_finite_gradient_whose_norm_overflows_is_applied_as_nan_not_zero():
    # test_safety.py's construction: inputs (a, -a), kernel (0.7, -0.7),
    # gradient (2.8e38, -2.8e38), finite, norm beyond float32. Its clip
    # factor would be subnormal (the CPU flushes it to 0: a silently zero
    # update). Without the gate it is applied as Keras' `global_clipnorm`
    # applies it (an infinite norm: every gradient NaN), never as zero.
    def build(cls, **options):
        inputs = keras.Input((2,))
        kernel = keras.initializers.Constant([[0.7], [-0.7]])
        layer = keras.layers.Dense(1, use_bias=False, kernel_initializer=kernel)
        return cls(inputs, layer(inputs), **options)

    x, y = np.array([[1e19, -1e19]], "float32"), np.zeros((1, 1), "float32")
    ref, model = build(keras.Model), build(FG, clip_norm=1.0, skip_nonfinite=False)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, verbose=0)
    model.fit(x, y, verbose=0)
    assert np.isnan(ref.get_weights()[0]).all()
    assert_same_pattern(ref, model)


# ----------------------------------- loss scaling: the gate still holds
def _loss_scaling_drops(options):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y, loss = bad_data("nan")
    keep = np.r_[0:4, 8:12]  # what reaches the weights: batch 1 dropped
    ref = linear(keras.Model)
    start = ref.get_weights()
    model = linear(FG, clip_norm=CLIP, skip_nonfinite=False, telemetry=True, **options)
    # A scale at which no finite batch overflows: only the NaN one drops.
    lso = keras.optimizers.LossScaleOptimizer
    ref.compile(optimizer=lso(keras.optimizers.Adam(0.01, global_clipnorm=CLIP), 2.0**8), loss=loss)
    model.compile(optimizer=lso(keras.optimizers.Adam(0.01), 2.0**8), loss=loss)
    ref_batch = 8 if "accumulation_steps" in options else 4
    ref.fit(x[keep], y[keep], batch_size=ref_batch, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert relative_error(ref, model, start) < 1e-3  # float16 forward passes
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    assert h.history["nonfinite_count"] == [1.0]


def test_loss_scaling_still_drops_a_nan_batch():
    _loss_scaling_drops({"accumulation_steps": 3})


@pytest.mark.parametrize("options", [{}, {"micro_batches": 2}], ids=["plain", "mb2"])
def test_loss_scaling_still_drops_a_nan_batch_sweep(options):
    _loss_scaling_drops(options)


# -------------------------------------------- clip_adaptive: never applied
LAMBDA = 0.05


def agc_reference(x, y, batches, lr=0.1):
    """keras.Model, a plain loop: its gradient, numpy AGC (kernels: per
    output unit; biases: whole), SGD; only on `batches` (slices)."""
    ref = mlp(keras.Model, features=3, outputs=1)
    ref.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    start = ref.get_weights()
    for rows in batches:
        _, grads = reference_gradients(
            ref,
            lambda rows=rows: ref.compute_loss(
                x=x[rows], y=y[rows], y_pred=ref(x[rows], training=True)
            ),
        )
        clipped = [
            np_agc(g, v.numpy(), LAMBDA, unit_axis=-1 if v.ndim > 1 else None)[0]
            for g, v in zip(grads, ref.trainable_variables)
        ]
        ref.optimizer.apply(
            [keras.ops.convert_to_tensor(c, "float32") for c in clipped], ref.trainable_variables
        )
    return ref, start


@pytest.mark.parametrize(
    "skip_nonfinite, telemetry",
    [(True, False), (False, False), (False, True)],
    ids=["skip", "unchecked", "unchecked-counted"],
)
def test_adaptive_clipping_never_applies_a_nan_batch(skip_nonfinite, telemetry):
    # skip_nonfinite=True: the step's single `cond`, AGC computed before it
    # (`before_gate`); False: no verdict gate, AGC's own check in the update.
    # With `telemetry=True` the verdict counts the NaN micro-batch and AGC's
    # drop of its update does not count it again: once in every case.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32") * 3.0
    x[5, 0] = np.nan  # batch 1 of 3
    ref, start = agc_reference(x, y, [slice(0, 4), slice(8, 12)])
    model = mlp(
        FG,
        features=3,
        outputs=1,
        clip_adaptive=LAMBDA,
        skip_nonfinite=skip_nonfinite,
        telemetry=telemetry,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert relative_error(ref, model, start) < 1e-5
    assert model.telemetry_counters()["nonfinite_count"] == 1.0


# ------------------------- no `cond` (skip_nonfinite=False): exact beyond an MLP
def _case(name):
    """`(builder, x, y, loss)`: the models of test_exactness.py (8 rows)
    and its embedding model; the masked GRU of test_extra_loss_terms.py."""
    rng = np.random.default_rng(31)
    if name == "embedding":
        x = rng.integers(0, 8, size=(8, 5)).astype("int32")
        return embedding_model, x, rng.normal(size=(8, 1)).astype("float32") * 5.0, "mse"
    if name == "masked_gru":
        x = rng.integers(1, 9, size=(8, 5)).astype("int32")
        x[:4, 2:] = 0  # padding: the loss's normaliser counts valid steps
        return masked_sequences_weights_only, x, rng.normal(size=(8, 5, 1)).astype("float32"), "mse"
    build, x, y, loss = _clip_case(name)
    if name != "training_branch":
        return build, x, y, loss

    def built(cls, **options):
        # Its training-only branch built too: Keras' JAX trainer cannot
        # create a layer's weights inside its traced step.
        model = build(cls, **options)
        model(x[:1], training=True)
        return model

    return built, x, y, loss


def _no_cond_pair(name, options):
    build, x, y, loss = _case(name)
    ref_sgd, ref_batch = keras.optimizers.SGD(0.1), 8 if options else 4
    if name == "batchnorm" and options:
        # Each micro-batch is normalised by its own moments (a documented
        # limit): the reference is Keras' own accumulation of two equal
        # batches, its statistics moving per micro-batch.
        options = {**options, "batchnorm_statistics": "micro_batch"}
        ref_sgd, ref_batch = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), 4
    ref, model = build(keras.Model), build(FG, skip_nonfinite=False, **options)
    model.set_weights(ref.get_weights())
    start = ref.get_weights()
    ref.compile(optimizer=ref_sgd, loss=loss)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    # Otherwise windows of two batches of 4 are one batch of 8.
    h_ref = ref.fit(x, y, batch_size=ref_batch, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert relative_error(ref, model, start) < 1e-5
    for a, b in zip(ref.get_weights(), model.get_weights()):  # BatchNorm's statistics too
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # (Keras' accumulating optimizer reports `iterations` as a tensor)
    ref_iterations = keras.ops.convert_to_numpy(ref.optimizer.iterations)
    assert int(model.optimizer.iterations.numpy()) == int(ref_iterations)
    if not options:
        np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


NAMES = ["masked_gru", "per_pixel_conv", "embedding", "batchnorm", "sequential", "training_branch"]
FAST = [("masked_gru", True), ("batchnorm", False), ("embedding", True)]


@pytest.mark.parametrize("name, accumulate", FAST)
def test_no_cond_path_is_exact_beyond_an_mlp(name, accumulate):
    _no_cond_pair(name, {"accumulation_steps": 2} if accumulate else {})


@pytest.mark.parametrize(
    "name, accumulate",
    [(n, a) for n in NAMES for a in (False, True) if (n, a) not in FAST],
)
def test_no_cond_path_is_exact_on_every_model(name, accumulate):
    _no_cond_pair(name, {"accumulation_steps": 2} if accumulate else {})
