"""Bring your own model (issue 10): `FastGradSequential`, `fastgrad(model)`
for existing models (functional, `Sequential`, a `keras.Model` subclass,
`keras.applications`, KerasHub), the callbacks on the `fit` of a plain
model, subclasses that call `super().__init__(inputs=..., outputs=...)`,
subclasses with their own `__init__` saved and cloned, legacy `.h5`.

References: plain `keras.Model` / `keras.Sequential` trained on the
concatenated batches (the window) or the same batches, and gradient norms
computed with a tape."""

import warnings

import keras
import numpy as np
import pytest

from keras_fastgrad import FastGradModel, FastGradSequential, fastgrad
from keras_fastgrad.callbacks import (
    GradientNormLogger,
    NonFiniteGuard,
    RetraceWatch,
    TapeVariableCounter,
)
from tests.helpers import data, max_weight_diff, mlp, reference_gradients


def sequential_layers(seed=3):
    keras.utils.set_random_seed(seed)
    return [
        keras.Input((3,)),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(1),
    ]


def weights_equal(a, b):
    return all(np.array_equal(p, q) for p, q in zip(a.get_weights(), b.get_weights()))


# ------------------------------------------------------------ Sequential
def test_sequential_accumulation_with_a_short_last_window_is_exact():
    # 40 samples in batches of 4: windows of 3 batches are 12, 12, 12 and a
    # short last one of 4 samples, applied at the end of each epoch.
    x, y = data(n=40)
    ref = keras.Sequential(sequential_layers())
    model = FastGradSequential(sequential_layers(), accumulation_steps=3)
    assert weights_equal(ref, model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 8  # 4 windows x 2 epochs


def test_sequential_without_options_trains_like_keras_sequential():
    x, y = data(n=24)
    ref = keras.Sequential(sequential_layers())
    model = FastGradSequential()  # built with `add`, no input shape
    for layer in sequential_layers()[1:]:
        model.add(layer)
    ref.compile(optimizer="adam", loss="mse")
    model.compile(optimizer="adam", loss="mse")
    h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-6)
    assert isinstance(model, keras.Sequential)


def test_sequential_saves_and_loads_with_its_options(tmp_path):
    x, y = data(n=16)
    model = FastGradSequential(sequential_layers(), accumulation_steps=2, clip_norm=0.5)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "seq.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is FastGradSequential
    assert (loaded.accumulation_steps, loaded.clip_norm) == (2, 0.5)
    assert weights_equal(model, loaded)


def test_sequential_checks_its_options():
    with pytest.raises(ValueError, match="accumulation_steps"):
        FastGradSequential(sequential_layers(), accumulation_steps=0)


# ------------------------------------------------------- fastgrad(model)
def test_fastgrad_functional_model_accumulates_exactly_and_saves(tmp_path):
    x, y = data(n=24)
    ref = mlp()
    model = fastgrad(mlp(), accumulation_steps=3)
    assert isinstance(model, FastGradModel)
    assert isinstance(model, keras.Model) and model.accumulation_steps == 3
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    path = str(tmp_path / "f.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, FastGradModel) and loaded.accumulation_steps == 3
    assert weights_equal(model, loaded)


def test_fastgrad_on_a_compiled_model_keeps_its_compile_settings():
    x, y = data(n=24)
    ref, model = mlp(), mlp()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    model.fit(x[:4], y[:4], verbose=0, epochs=0)  # a plain fit before
    model = fastgrad(model, accumulation_steps=2)
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert "mae" in h.history


class Classifier(keras.Model):
    """A user's subclass with its own `__init__`, config and method."""

    def __init__(self, units=6, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.hidden(x))

    def describe(self):
        return f"classifier with {self.units} units"

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def make_classifier(seed=5):
    keras.utils.set_random_seed(seed)
    model = Classifier(units=6)
    model(np.zeros((1, 3), "float32"))
    return model


def test_fastgrad_subclass_keeps_its_class_methods_weights_and_saves(tmp_path):
    x, y = data(n=24)
    ref, model = make_classifier(), make_classifier()
    weights = model.hidden.kernel
    model = fastgrad(model, clip_norm=0.05)
    assert isinstance(model, Classifier) and isinstance(model, FastGradModel)
    assert model.describe() == "classifier with 6 units"
    assert model.hidden.kernel is weights  # the same variables
    ref.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.05), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    path = str(tmp_path / "c.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Classifier": Classifier})
    assert isinstance(loaded, Classifier) and isinstance(loaded, FastGradModel)
    assert loaded.clip_norm == 0.05 and loaded.units == 6
    assert weights_equal(model, loaded)
    clone = keras.models.clone_model(model)
    assert isinstance(clone, Classifier) and clone.clip_norm == 0.05


class OwnStep(keras.Model):
    # A layer: Keras' JAX `fit` builds the model before the callbacks run.
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, *args):  # TF: `(data)`; JAX: `(state, data)`
        return {}


def test_fastgrad_refuses_a_class_with_its_own_train_step():
    with pytest.raises(ValueError, match="overrides `train_step`"):
        fastgrad(OwnStep())
    with pytest.raises(ValueError, match="overrides `train_step`"):
        model = OwnStep()
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0, callbacks=[GradientNormLogger()])


def test_fastgrad_checks_its_arguments():
    with pytest.raises(TypeError, match="keras.Model"):
        fastgrad(keras.layers.Dense(1))
    with pytest.raises(TypeError, match="accumulaton_steps"):
        fastgrad(mlp(), accumulaton_steps=2)
    with pytest.raises(ValueError, match="clip_norm"):
        fastgrad(mlp(), clip_norm=-1.0)
    model = fastgrad(mlp(), accumulation_steps=2)
    assert fastgrad(model, accumulation_steps=2) is model
    with pytest.raises(ValueError, match="already is a `FastGradModel`"):
        fastgrad(model, accumulation_steps=4)
    # An aggregator compares by its config: the same method is no change.
    multitask = fastgrad(mlp(), multitask="pcgrad")
    assert fastgrad(multitask) is multitask
    assert fastgrad(multitask, multitask="pcgrad") is multitask
    with pytest.raises(ValueError, match="already is a `FastGradModel`"):
        fastgrad(multitask, multitask="mgda")


def test_fastgrad_mobilenet_v3_small_trains_like_keras_model(tmp_path):
    def build():
        keras.utils.set_random_seed(11)
        return keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3),
            weights=None,
            classes=4,
            dropout_rate=0.0,
            include_preprocessing=False,
        )

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, size=(8,))
    ref, model = build(), fastgrad(build())
    assert weights_equal(ref, model)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # BatchNorm moving statistics included (`get_weights` holds them).
    assert max_weight_diff(ref, model) < 1e-5
    path = str(tmp_path / "mobilenet.keras")
    model.save(path)
    assert weights_equal(keras.models.load_model(path), model)


# ------------------------------------------------ KerasHub (if installed)
def tiny_bert_classifier(seed=2):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0
    )


def bert_batch(n=8):
    rng = np.random.default_rng(1)
    x = {
        "token_ids": rng.integers(1, 50, size=(n, 8)).astype("int32"),
        "segment_ids": np.zeros((n, 8), "int32"),
        "padding_mask": np.ones((n, 8), "int32"),
    }
    return x, rng.integers(0, 3, size=(n,))


@pytest.mark.needs_tensorflow(reason="KerasHub imports TensorFlow")
def test_fastgrad_kerashub_classifier_accumulates_exactly_and_saves(tmp_path):
    x, y = bert_batch()
    ref, model = tiny_bert_classifier(), tiny_bert_classifier()
    model = fastgrad(model, accumulation_steps=2)
    assert isinstance(model, type(ref)) and isinstance(model, FastGradModel)
    assert model.backbone is not None  # the task's own attributes
    for m in (ref, model):
        m.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5
    path = str(tmp_path / "bert.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, type(ref)) and isinstance(loaded, FastGradModel)
    assert loaded.accumulation_steps == 2
    assert weights_equal(model, loaded)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.needs_tensorflow(reason="KerasHub imports TensorFlow")
def test_callbacks_on_a_plain_kerashub_fit_leave_its_training_bit_identical():
    x, y = bert_batch()
    ref, model = tiny_bert_classifier(), tiny_bert_classifier()
    cls = type(model)
    for m in (ref, model):
        m.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ref.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    h = model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[GradientNormLogger(), TapeVariableCounter()],
    )
    if keras.backend.backend() == "jax":
        # XLA compiles the step with the norm's reduction as one program and
        # may fuse the backward pass differently: equal to its rounding
        # (3.6e-12 measured on this BERT), not bit for bit.
        assert max_weight_diff(ref, model) < 1e-9
    else:
        assert weights_equal(ref, model)
    assert h.history["tape_variables"][0] == len(model.trainable_variables)
    assert np.isfinite(h.history["grad_norm"][0]) and h.history["grad_norm"][0] > 0
    assert type(model) is cls


# ------------------------------------------------ callbacks on plain fits
def all_callbacks():
    return [GradientNormLogger(), TapeVariableCounter(), RetraceWatch(), NonFiniteGuard()]


def test_callbacks_on_a_plain_sequential_leave_its_training_bit_identical():
    x, y = data(n=16)
    ref = keras.Sequential(sequential_layers())
    model = keras.Sequential(sequential_layers())
    for m in (ref, model):
        m.compile(optimizer="adam", loss="mse")
    h_ref = ref.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=all_callbacks())
    assert weights_equal(ref, model)
    assert h.history["loss"] == h_ref.history["loss"]
    for key in (
        "grad_norm",
        "tape_variables",
        "trainable_variables",
        "train_traces",
        "nonfinite_count",
    ):
        assert key in h.history, key
    # After `fit` the model is a plain `keras.Sequential` again.
    assert type(model) is keras.Sequential
    assert "grad_norm" not in model.fit(x, y, epochs=1, verbose=0).history


def test_callbacks_on_a_plain_sequential_log_the_tape_gradient_norm():
    x, y = data(n=8)
    model = keras.Sequential(sequential_layers())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    _, grads = reference_gradients(model, lambda: keras.ops.mean(keras.ops.square(model(x) - y)))
    expected = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads)))
    h = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[GradientNormLogger()])
    np.testing.assert_allclose(h.history["grad_norm"][0], expected, rtol=1e-5)
    assert type(model) is keras.Sequential  # itself again after `fit`


def test_callbacks_on_a_plain_model_apply_nonfinite_gradients_like_keras():
    # Default options of the attached step: nothing skipped, exactly like
    # `keras.Model` (which applies a NaN gradient).
    x, y = data(n=8)
    y[0, 0] = np.nan
    ref, model = mlp(), mlp()
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = model.fit(
            x, y, batch_size=8, epochs=1, verbose=0, callbacks=[NonFiniteGuard(action="warn")]
        )
    assert np.isnan(model.get_weights()[0]).all() == np.isnan(ref.get_weights()[0]).all()
    assert h.history["nonfinite_count"][0] == 1.0


# ----------------------------------- subclasses, configs, legacy files
class FunctionalSubclass(FastGradModel):
    def __init__(self, **kwargs):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, name="out")(inputs)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)


class PlainSubclass(FastGradModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def test_functional_subclass_does_not_rewrite_fastgradmodel():
    model = FunctionalSubclass(accumulation_steps=2)
    assert isinstance(model, FunctionalSubclass) and model.accumulation_steps == 2
    assert keras.Model in FastGradModel.__bases__  # not `Functional`
    later = PlainSubclass(clip_norm=1.0)  # failed when the bases were rewritten
    later.compile(optimizer="sgd", loss="mse")
    later.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    x, y = data(n=8)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


class ReadmeNet(FastGradModel):
    """The README's subclass: options fixed by its own `__init__`."""

    def __init__(self, **kwargs):
        super().__init__(accumulation_steps=4, **kwargs)
        self.dense = keras.layers.Dense(2, name="dense")

    def call(self, x):
        return self.dense(x)


def test_readme_subclass_saves_loads_and_clones(tmp_path):
    model = ReadmeNet(clip_norm=0.5)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=2, verbose=0)
    path = str(tmp_path / "net.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"ReadmeNet": ReadmeNet})
    assert (loaded.accumulation_steps, loaded.clip_norm) == (4, 0.5)
    assert weights_equal(model, loaded)
    clone = keras.models.clone_model(model)
    assert (clone.accumulation_steps, clone.clip_norm) == (4, 0.5)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_legacy_h5_files_load_without_custom_objects(tmp_path, kind):
    if kind == "functional":
        model = mlp(FastGradModel, accumulation_steps=2)
    else:
        model = FastGradSequential(sequential_layers(), accumulation_steps=2)
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())
    x, y = data(n=8)
    model.fit(x, y, batch_size=4, verbose=0)
    path = str(tmp_path / "m.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded).__name__ == type(model).__name__
    assert loaded.accumulation_steps == 2
    assert weights_equal(model, loaded)


def test_pickled_models_keep_their_class_and_options():
    import pickle

    x, y = data(n=8)
    functional = mlp(FastGradModel, accumulation_steps=2)
    adapted = fastgrad(make_classifier(), clip_norm=0.5)
    for model in (functional, adapted):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        keras.saving.get_custom_objects()["Classifier"] = Classifier
        try:
            copy = pickle.loads(pickle.dumps(model))
        finally:
            del keras.saving.get_custom_objects()["Classifier"]
        assert type(copy).__name__ == type(model).__name__
        assert (copy.accumulation_steps, copy.clip_norm) == (
            model.accumulation_steps,
            model.clip_norm,
        )
        assert weights_equal(copy, model)
