"""Refusals that leave nothing half-done (issue 27: 3, 5, 8).

- A subclass with a `train_step` of its own that never calls
  `FastGradModel.train_step` is refused when an option (or a callback's
  telemetry) would be silently ignored, before any weight moves; one that
  calls it gets the options (against `keras.Model` on the big batch).
- A refused `fastgrad()` / `compile` leaves the model as it was: class,
  config and the next `fit` equal an untouched copy's (`keras.Model`).
- Another Keras backend is refused at `import keras_fastgrad`.

Runs on both backends: the steps of their own take Keras' JAX form,
`train_step(state, data)`, under `KERAS_BACKEND=jax`.
"""

import importlib.util
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_fastgrad import FastGradModel, fastgrad
from keras_fastgrad.callbacks import TapeVariableCounter
from keras_fastgrad.models.model import OPTION_NAMES
from tests.helpers import (
    max_weight_diff,
    tf,  # (TensorFlow imported at first use: not on JAX)
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ON_JAX = keras.backend.backend() == "jax"


# ------------------------------------------- 3. a train_step of its own
def own_train_step(model, *step_args):
    """A GAN-like step: its own gradient and its own optimizer (made in
    `compile`), no `FastGradModel.train_step`. Keras calls it with
    `(data)` on TensorFlow, `(state, data)` on JAX."""
    if ON_JAX:
        return _own_jax_step(model, *step_args)
    (data,) = step_args
    x, y = data
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        pairs = zip(y, y_pred) if isinstance(y_pred, list) else [(y, y_pred)]
        loss = sum(keras.ops.mean(keras.ops.square(t - p)) for t, p in pairs)
    variables = model.trainable_variables
    grads = tape.gradient(loss, [v.value for v in variables])
    model.own_optimizer.apply(grads, variables)
    return {"loss": loss}


def _squared_error(y, y_pred):
    pairs = zip(y, y_pred) if isinstance(y_pred, list) else [(y, y_pred)]
    return sum(keras.ops.mean(keras.ops.square(t - p)) for t, p in pairs)


def _own_jax_step(model, state, data):
    """The same step in the form of Keras' JAX guide: stateless, on the
    state tuple (its optimizer is the compiled one: Keras threads only its
    variables)."""
    import jax

    trainable, non_trainable, optimizer_variables, metrics = state
    x, y = data

    def loss_of(values):
        y_pred, updated = model.stateless_call(values, non_trainable, x)
        return _squared_error(y, y_pred), updated

    (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
    trainable, optimizer_variables = model.own_optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics)


def _own_optimizer(model):
    """The step's own optimizer, made in `compile`; on JAX the compiled
    one (`compile(optimizer=SGD(0.1))`): only its variables ride in the
    state tuple."""
    return model.optimizer if ON_JAX else keras.optimizers.SGD(0.1)


def _compile_kwargs(kwargs):
    return {"optimizer": keras.optimizers.SGD(0.1), **kwargs} if ON_JAX else kwargs


def _two_layers(model, heads):
    model.trunk = keras.layers.Dense(4, activation="tanh", name="trunk")
    model.heads = [keras.layers.Dense(1, name=f"head_{i}") for i in range(heads)]


def _forward(model, x):
    z = model.trunk(x)
    outputs = [head(z) for head in model.heads]
    return outputs[0] if len(outputs) == 1 else outputs


class OwnStep(FastGradModel):
    def __init__(self, heads=1, **options):
        super().__init__(**options)
        _two_layers(self, heads)

    def call(self, x):
        return _forward(self, x)

    def compile(self, **kwargs):
        super().compile(**_compile_kwargs(kwargs))
        self.own_optimizer = _own_optimizer(self)

    def train_step(self, *step_args):  # TF: (data); JAX: (state, data)
        return own_train_step(self, *step_args)


class PlainOwnStep(keras.Model):  # the reference: the same step on keras.Model
    def __init__(self, heads=1):
        super().__init__()
        _two_layers(self, heads)

    call = OwnStep.call

    def train_step(self, *step_args):
        return own_train_step(self, *step_args)

    def compile(self, **kwargs):
        super().compile(**_compile_kwargs(kwargs))
        self.own_optimizer = _own_optimizer(self)


def _own_step_pair(heads, **options):
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = [rng.normal(size=(12, 1)).astype("float32") for _ in range(heads)]
    model, reference = OwnStep(heads, **options), PlainOwnStep(heads)
    for m in (model, reference):
        m.compile(loss=["mse"] * heads if heads > 1 else "mse")
        m(x[:1])
    model.set_weights(reference.get_weights())
    return model, reference, x, y if heads > 1 else y[0]


# Every option set to a value that `FastGradModel.train_step` alone acts on.
IGNORED = [
    ({"accumulation_steps": 3}, 1),
    ({"clip_norm": 1.0}, 1),
    ({"clip_adaptive": 0.01}, 1),
    ({"clip_adaptive": 0.01, "clip_adaptive_eps": 0.01}, 1),
    ({"multitask": "pcgrad"}, 2),
    ({"multitask": "mgda", "multitask_space": "features", "multitask_features": "trunk"}, 2),
    ({"micro_batches": 2}, 1),
    ({"telemetry": True}, 1),
    ({"batchnorm_statistics": "micro_batch"}, 1),
    ({"max_consecutive_nonfinite": 3}, 1),
]
# Values a step of its own honours anyway (it never drops a non-finite
# gradient, never stops a run), and the defaults.
HONOURED = [{}, {"skip_nonfinite": False}, {"max_consecutive_nonfinite": None}]


def test_every_option_has_a_case():
    assert set(OPTION_NAMES) == {n for case, _ in IGNORED for n in case} | {
        n for case in HONOURED for n in case
    }


@pytest.mark.parametrize("options, heads", IGNORED, ids=lambda v: str(v))
def test_own_step_refuses_options_it_would_ignore_before_any_update(options, heads):
    model, _, x, y = _own_step_pair(heads, **options)
    start = model.get_weights()
    last = list(options)[-1]
    with pytest.raises(
        ValueError,
        match=rf"`OwnStep` overrides `train_step`.*did not call `FastGradModel.train_step`"
        rf".*silently ignored.*Received: .*{last}=.*Fix: call `super\(\).train_step\(data\)`",
    ):
        model.fit(x, y, batch_size=4, verbose=0)
    assert max_weight_diff(model, _Weights(start)) == 0.0
    assert int(model.own_optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("options", HONOURED, ids=str)
def test_own_step_with_honoured_options_trains_like_keras_model(options):
    model, reference, x, y = _own_step_pair(1, **options)
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    assert int(model.own_optimizer.iterations.numpy()) == 3
    assert max_weight_diff(model, reference) == 0.0


def test_own_step_refused_under_run_eagerly_too():
    # No trace to check at: the error comes after the first batch's step.
    model, _, x, y = _own_step_pair(1, clip_norm=1.0)
    model.compile(loss="mse", run_eagerly=True)
    with pytest.raises(ValueError, match=r"Received: clip_norm=1\.0"):
        model.fit(x, y, batch_size=4, verbose=0)
    # On JAX the step returns its new state: raised, it is never kept.
    assert int(model.own_optimizer.iterations.numpy()) == (0 if ON_JAX else 1)


def test_own_step_refuses_a_callbacks_telemetry():
    model, _, x, y = _own_step_pair(1)
    with pytest.raises(
        ValueError, match=r"callbacks read.*Received: telemetry keys \['tape_variables'\]"
    ):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[TapeVariableCounter()])
    assert int(model.own_optimizer.iterations.numpy()) == 0


class Extends(FastGradModel):
    """Adds to the step and calls `super().train_step(data)`: a Conv2D
    model with a per-pixel loss."""

    def __init__(self, **options):
        super().__init__(**options)
        self.conv = keras.layers.Conv2D(3, 3, padding="same", activation="tanh")
        self.out = keras.layers.Conv2D(1, 1)

    def call(self, x):
        return self.out(self.conv(x))

    def train_step(self, *step_args):  # TF: (data); JAX: (state, data)
        return _with_twice_the_loss(super().train_step(*step_args))


def _with_twice_the_loss(outputs):
    """The step's logs with one more key (JAX: `(logs, state)`)."""
    logs, state = outputs if ON_JAX else (outputs, None)
    logs = {**logs, "twice_the_loss": 2.0 * logs["loss"]}
    return (logs, state) if ON_JAX else logs


class Chained(Extends):  # an override of an override, both calling super
    def train_step(self, *step_args):
        return super().train_step(*step_args)


class Direct(Extends):  # names the class instead of `super()`, via a helper
    def train_step(self, *step_args):
        return self._step(*step_args)

    def _step(self, *step_args):
        return _with_twice_the_loss(FastGradModel.train_step(self, *step_args))


@pytest.mark.parametrize("cls", [Extends, Chained, Direct], ids=lambda c: c.__name__)
def test_an_override_calling_the_base_step_gets_the_options(cls):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(3, 3, padding="same", activation="tanh")(inputs)
    reference = keras.Model(inputs, keras.layers.Conv2D(1, 1)(hidden))
    reference.compile(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05), loss="mse")
    model = cls(accumulation_steps=2, clip_norm=0.05)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(16, 6, 6, 1)).astype("float32")
    model(x[:1])
    model.set_weights(reference.get_weights())
    history = model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    assert "twice_the_loss" in history.history
    assert int(model.optimizer.iterations.numpy()) == 2
    assert model.telemetry_counters()["clipped_updates"] == 2.0  # the clip acted
    assert max_weight_diff(model, reference) < 1e-6


class KerasOwnStep(keras.Model):  # calls keras.Model's step
    def train_step(self, data):
        return super().train_step(data)


def test_fastgrad_refuses_a_class_with_its_own_step_and_leaves_it():
    model = KerasOwnStep(*_functional_parts())
    model.compile(optimizer="sgd", loss="mse")
    config = model.get_config()
    with pytest.raises(ValueError, match="`KerasOwnStep` overrides `train_step`"):
        fastgrad(model, accumulation_steps=2)
    assert type(model) is KerasOwnStep and model.get_config() == config
    assert "fastgrad_step_state" not in vars(model)


def _functional_parts():
    inputs = keras.Input((3,))
    return inputs, keras.layers.Dense(1)(inputs)


# ---------------------------------------- 5. a refused fastgrad/compile
def conv_per_pixel():
    inputs = keras.Input((6, 6, 2), name="x")
    hidden = keras.layers.Conv2D(3, 3, padding="same", activation="relu", name="c1")(inputs)
    model = keras.Model(inputs, keras.layers.Conv2D(1, 1, name="c2")(hidden), name="net")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(12, 6, 6, 2)).astype("float32")
    return model, x, rng.normal(size=(12, 6, 6, 1)).astype("float32")


def masked_rnn():
    inputs = keras.Input((5,), dtype="int32", name="x")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True, name="embed")(inputs)
    hidden = keras.layers.GRU(3, name="gru")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden), name="net")
    rng = np.random.default_rng(3)
    x = rng.integers(1, 10, size=(12, 5))
    x[:, 3:] *= rng.integers(0, 2, size=(12, 2))  # padded ends
    return model, x, rng.normal(size=(12, 1)).astype("float32")


def sequential_batchnorm():
    model = keras.Sequential(
        [
            keras.Input((3,), name="x"),
            keras.layers.Dense(4, name="d1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(1, name="d2"),
        ],
        name="net",
    )
    rng = np.random.default_rng(4)
    x = rng.normal(size=(12, 3)).astype("float32")
    return model, x, rng.normal(size=(12, 1)).astype("float32")


REFUSED_FASTGRAD = [
    (
        conv_per_pixel,
        lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
        {"accumulation_steps": 2},
        "Gradient accumulation is set twice",
    ),
    (
        masked_rnn,
        lambda: keras.optimizers.SGD(0.1, clipnorm=0.01),
        {"clip_norm": 0.01},
        "Gradient clipping is set twice",
    ),
    (
        sequential_batchnorm,
        lambda: keras.optimizers.SGD(0.1),
        {"multitask": "pcgrad"},
        "a multi-task method needs at least two task losses",
    ),
]


@pytest.mark.parametrize(
    "build, optimizer, options, match", REFUSED_FASTGRAD, ids=lambda v: getattr(v, "__name__", "")
)
def test_a_refused_fastgrad_leaves_the_model_as_it_was(build, optimizer, options, match):
    keras.utils.set_random_seed(11)
    model, x, y = build()
    keras.utils.set_random_seed(11)
    untouched, _, _ = build()
    for m in (model, untouched):
        m.compile(optimizer=optimizer(), loss="mse")
    config = model.get_config()
    with pytest.raises(ValueError, match=match):
        fastgrad(model, **options)
    assert type(model) is type(untouched) and not isinstance(model, FastGradModel)
    assert model.get_config() == config
    assert "fastgrad_step_state" not in vars(model)
    for m in (model, untouched):
        m.fit(x, y, batch_size=3, epochs=2, verbose=0, shuffle=False)
    iterations = [keras.ops.convert_to_numpy(m.optimizer.iterations) for m in (model, untouched)]
    assert iterations[0] == iterations[1]
    assert max_weight_diff(model, untouched) == 0.0


def test_a_refused_compile_leaves_the_model_uncompiled():
    inputs, outputs = _functional_parts()
    model = FastGradModel(inputs, outputs, accumulation_steps=2)
    with pytest.raises(ValueError, match="Gradient accumulation is set twice"):
        model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse")
    assert not model.compiled and getattr(model, "optimizer", None) is None
    with pytest.raises(ValueError, match="compile"):
        model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    single = FastGradModel(*_functional_parts(), multitask="pcgrad")
    with pytest.raises(ValueError, match="at least two task losses"):
        single.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="compile"):
        single.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)


class _Weights:  # `max_weight_diff`'s view of a list of arrays
    def __init__(self, weights):
        self.weights = weights

    def get_weights(self):
        return self.weights


# ------------------------------------------------- 8. another backend
_IMPORT = """
import keras
{patch}
import keras_fastgrad
print("imported", keras.backend.backend())
"""


def _import_under(backend, patch=""):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-c", _IMPORT.format(patch=patch)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


REFUSAL = (
    r"ImportError: keras_fastgrad supports Keras' TensorFlow and JAX backends.*Received: "
    r"keras.backend.backend\(\)='{}'.*Fix: set the environment variable "
    r"`KERAS_BACKEND=tensorflow`"
)


def _needs(module):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed"
    )


@pytest.mark.parametrize(
    "backend",
    [
        # Keras' numpy backend imports jax too (`keras.src.backend.numpy.math`).
        pytest.param("numpy", marks=_needs("jax")),
        pytest.param("torch", marks=_needs("torch")),
    ],
)
def test_another_backend_is_refused_at_import(backend):
    done = _import_under(backend)
    assert done.returncode != 0 and "imported" not in done.stdout
    assert re.search(REFUSAL.format(backend), done.stderr, flags=re.DOTALL)


@pytest.mark.needs_tensorflow(reason="a process under KERAS_BACKEND=tensorflow")
def test_the_backend_check_names_what_keras_reports():
    # Runs everywhere (no other backend installed): Keras reports "torch".
    done = _import_under("tensorflow", patch='keras.backend.backend = lambda: "torch"')
    assert done.returncode != 0 and "imported" not in done.stdout
    assert re.search(REFUSAL.format("torch"), done.stderr, flags=re.DOTALL)


@_needs("jax")
def test_the_jax_backend_imports():
    # Supported (a first set of options: the `*_jax.py` tests); the others refuse there.
    done = _import_under("jax")
    assert done.returncode == 0 and "imported jax" in done.stdout, done.stderr[-2000:]


def test_the_tests_run_under_the_backend_asked_for():
    # conftest.py selects TensorFlow, for this process and every
    # subprocess, unless the run asked for JAX (`KERAS_BACKEND=jax`).
    assert os.environ["KERAS_BACKEND"] in ("tensorflow", "jax")
    assert keras.backend.backend() == os.environ["KERAS_BACKEND"]
