"""Variables that appear late train like `keras.Model` (issue 10, items 2-3).

Keras builds the optimizer on its first update, so a layer used only when
`training=True`, or a model built by `model.build(shape)` before `fit`,
trains; and it builds an unbuilt model symbolically only under a
distribution strategy, so `run_eagerly=True` models may run eager-only
Python in `call`. Each test trains a plain `keras.Model` the same way as the
reference.

On Keras' JAX backend `keras.Model` does neither: its step runs on the
state it is handed (a layer cannot create variables inside it: the
optimizer, built before, gets more variables than it was built for) and
`fit` always builds the model symbolically first (eager-only Python in
`call` fails there). There the tests expect `keras.Model`'s failure from
both, then train the late variables made before `fit` (one call with
`training=True`) like `keras.Model`.
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import (
    data,
    max_weight_diff,
    tf,  # (TensorFlow imported at first use: not on JAX)
)

ON_JAX = keras.backend.backend() == "jax"


def _dense(units, seed, name):
    # Seeded initialisers: the same weights whatever order layers build in.
    return keras.layers.Dense(
        units,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        name=name,
    )


def _aux_head_class(base):
    class AuxHead(base):
        """An auxiliary head whose variables exist only once `call` runs
        with `training=True`."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = _dense(5, 1, "hidden")
            self.out = _dense(1, 2, "out")
            self.aux = _dense(1, 3, "aux")

        def call(self, x, training=None):
            h = keras.ops.tanh(self.hidden(x))
            y = self.out(h)
            if training:
                y = y + 0.5 * self.aux(h)
            return y

    return AuxHead


def _eager_only_class(base):
    class EagerOnly(base):
        """`call` reads tensor values in Python: works only eagerly."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = _dense(5, 1, "hidden")
            self.out = _dense(1, 2, "out")

        def call(self, x):
            h = keras.ops.tanh(self.hidden(x))
            if float(keras.ops.sum(x)) > -1e9:  # a Python `if` on a value
                h = h * 2.0
            if np.all(np.isfinite(np.asarray(x))):
                h = h + 1.0
            return self.out(h)

    return EagerOnly


def _train(model, batch_size, build=False, run_eagerly=False, epochs=2, made_first=False):
    x, y = data(n=12)
    if build:
        model.build((None, 3))
    if made_first:  # every variable, the training-only ones too, before `fit`
        model(x[:1], training=True)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def _assert_same_weights(model, reference):
    # The same variables, in the same order (paths start with the model's name).
    names = [v.path.split("/", 1)[1] for v in model.weights]
    assert names == [v.path.split("/", 1)[1] for v in reference.weights]
    assert max_weight_diff(model, reference) < 1e-6


def _late_variables_fail_as_in_keras_model(options, batch_size, **kwargs):
    """JAX: `keras.Model` and `FastGradModel` fail on variables made inside
    the step (Keras' optimizer check; ours names the cause and the fix)."""
    for base, base_options, error in (
        (keras.Model, {}, r"corresponding 1:1 to .*built with 4 variables"),
        (
            keras_fastgrad.FastGradModel,
            options,
            r"built for 4, the model now has 6 \(a layer made variables inside the train step.*"
            r"Fix: make every variable before `fit`",
        ),
    ):
        with pytest.raises(ValueError, match=error):
            _train(_aux_head_class(base)(**base_options), batch_size, **kwargs)


@pytest.mark.parametrize("build", [False, True], ids=["unbuilt", "build_shape"])
@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_training_only_layer_trains_like_keras_model(build, run_eagerly):
    if ON_JAX:
        if not run_eagerly:  # (eagerly: Keras' check of the layer's own list)
            _late_variables_fail_as_in_keras_model({}, 3, build=build)
    kwargs = {"build": build, "run_eagerly": run_eagerly, "made_first": ON_JAX}
    reference = _train(_aux_head_class(keras.Model)(), 3, **kwargs)
    model = _train(_aux_head_class(keras_fastgrad.FastGradModel)(), 3, **kwargs)
    assert len(model.trainable_variables) == 6  # the head's too
    _assert_same_weights(model, reference)


@pytest.mark.parametrize("build", [False, True], ids=["unbuilt", "build_shape"])
def test_training_only_layer_is_accumulated(build):
    # Two micro-batches of 3 per update equal one batch of 6: the
    # accumulators must cover the head's variables too.
    if ON_JAX:
        _late_variables_fail_as_in_keras_model({"accumulation_steps": 2}, 3, build=build)
    reference = _train(_aux_head_class(keras.Model)(), 6, build=build, made_first=ON_JAX)
    model = _train(
        _aux_head_class(keras_fastgrad.FastGradModel)(accumulation_steps=2),
        3,
        build=build,
        made_first=ON_JAX,
    )
    assert len(model.fastgrad_step_state.accumulator.variables) > len(model.trainable_variables)
    assert int(model.optimizer.iterations.numpy()) == 4
    _assert_same_weights(model, reference)


@pytest.mark.parametrize("build", [False, True], ids=["unbuilt", "build_shape"])
@pytest.mark.parametrize(
    "options", [{}, {"accumulation_steps": 2}], ids=["default", "accumulation"]
)
def test_run_eagerly_with_eager_only_call_trains_like_keras_model(options, build):
    batch_size = 3 * options.get("accumulation_steps", 1)
    if ON_JAX:
        for base, base_options in ((keras.Model, {}), (keras_fastgrad.FastGradModel, options)):
            with pytest.raises(RuntimeError, match=SYMBOLIC_BUILD_FAILS):
                _train(_eager_only_class(base)(**base_options), 3, build=build, run_eagerly=True)
        return
    reference = _train(_eager_only_class(keras.Model)(), batch_size, build=build, run_eagerly=True)
    model = _train(
        _eager_only_class(keras_fastgrad.FastGradModel)(**options),
        3,
        build=build,
        run_eagerly=True,
    )
    _assert_same_weights(model, reference)


# JAX: Keras' `fit` and `train_on_batch` build the model symbolically first.
SYMBOLIC_BUILD_FAILS = "Unable to automatically build the model"


def test_run_eagerly_train_on_batch_with_eager_only_call():
    x, y = data(n=6)
    models = []
    for base in (keras.Model, keras_fastgrad.FastGradModel):
        model = _eager_only_class(base)()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", run_eagerly=True)
        if ON_JAX:  # as keras.Model fails
            with pytest.raises(RuntimeError, match=SYMBOLIC_BUILD_FAILS):
                model.train_on_batch(x, y)
            continue
        for _ in range(3):
            model.train_on_batch(x, y)
        models.append(model)
    if not ON_JAX:
        _assert_same_weights(models[1], models[0])


def mirrored_training_only_layer(strategy):
    """The auxiliary head under `strategy` (two replicas) against
    `keras.Model` on one device: run by distributed_cases.py (the process
    with two logical CPUs), asserted by end_to_end/test_distributed.py."""
    x, y = data(n=12)
    result = {}
    for name, options in (("plain", {}), ("accumulation_steps=2", {"accumulation_steps": 2})):
        models = []
        for base, scope, batch_size in (
            (keras.Model, tf.distribute.get_strategy(), 6),
            (keras_fastgrad.FastGradModel, strategy, 6 // options.get("accumulation_steps", 1)),
        ):
            with scope.scope():
                model = _aux_head_class(base)(**(options if base is not keras.Model else {}))
                model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
            model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
            models.append(model)
        result[name] = {
            "trainable_variables": len(models[1].trainable_variables),
            "max_weight_diff": max_weight_diff(models[1], models[0]),
        }
    return result


# ------------------------------------- the build reads no data (issue 18, B)
class ShuffledBatches(keras.utils.PyDataset):
    """Batches of 3 whose order `on_epoch_end` reshuffles with its own
    seeded generator; counts its epoch ends."""

    def __init__(self, x, y, seed=5):
        super().__init__()
        self.x, self.y = x, y
        self.rng = np.random.default_rng(seed)
        self.order = np.arange(len(x))
        self.epoch_ends = 0

    def __len__(self):
        return len(self.x) // 3

    def __getitem__(self, i):
        rows = self.order[3 * i : 3 * i + 3]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epoch_ends += 1
        self.rng.shuffle(self.order)


def _batches(x, y, seen):
    for i in range(0, len(x), 3):
        seen.append(i)
        yield x[i : i + 3], y[i : i + 3]


def _fit_twice(base, source):
    keras.utils.set_random_seed(11)
    x, y = data(n=12)
    model = _aux_head_class(base)()
    if ON_JAX:  # its late variables made before `fit` (see the module docstring)
        model(x[:1], training=True)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    seen = []
    if source == "pydataset":
        dataset = ShuffledBatches(x, y)
        kwargs = {"x": dataset, "shuffle": True}
    elif source == "tf.data":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(12).batch(3)
        kwargs = {"x": dataset}
    elif source == "numpy":
        dataset = None
        kwargs = {"x": x, "y": y, "batch_size": 3, "shuffle": True}
    else:  # a generator: 2 epochs of 2 batches, out of its 4
        dataset = None
        kwargs = {"x": _batches(x, y, seen), "steps_per_epoch": 2}
    history = model.fit(epochs=2, verbose=0, **kwargs)
    return model, history.history["loss"], dataset, seen


@pytest.mark.parametrize(
    "source",
    [
        "pydataset",
        pytest.param("tf.data", marks=pytest.mark.needs_tensorflow(reason="a tf.data pipeline")),
        "numpy",
        "generator",
    ],
)
def test_same_seed_same_run_as_keras_model(source):
    reference, reference_loss, reference_data, reference_seen = _fit_twice(keras.Model, source)
    model, loss, dataset, seen = _fit_twice(keras_fastgrad.FastGradModel, source)
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)
    _assert_same_weights(model, reference)
    if source == "pydataset":  # one shuffle per epoch end, as in Keras
        assert dataset.epoch_ends == reference_data.epoch_ends
    if source == "generator":  # no batch lost to the build
        assert seen == reference_seen
