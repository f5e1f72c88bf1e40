"""Writes the saved-file fixtures that later releases must keep loading.

Run with the release whose files they are (its commit names the files):

    PYTHONPATH=<checkout of that commit> python tests/data/make_saved_fixtures.py <commit>

For each case it writes `<case>_<commit>.keras`, `<case>_<commit>.weights.h5`
and `<case>_<commit>.npz` (the weights and the step state's values as that
release saw them, read back by `tests/end_to_end/test_saved_fixtures.py`).
Every model is trained on `fixture_data()` for 3 batches of 2 rows: with
`accumulation_steps=2` its window is half full when saved.
"""

import os
import sys

import keras
import numpy as np

import keras_fastgrad


def fixture_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    return x, y


def _functional(cls, **options):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def plain():
    return _functional(keras_fastgrad.FastGradModel)


def mid_window():
    return _functional(keras_fastgrad.FastGradModel, accumulation_steps=2)


def multitask_gradvac():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    return keras_fastgrad.FastGradModel(inputs, outputs, multitask="gradvac")


def sequential():
    keras.utils.set_random_seed(7)
    return keras_fastgrad.FastGradSequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)],
        accumulation_steps=2,
    )


@keras.saving.register_keras_serializable(package="fixtures")
class Regressor(keras.Model):
    """A subclassed model with a training-only branch (deterministic, so
    a resumed run can be compared exactly)."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x, training=False):
        h = self.hidden(x)
        if training:
            h = keras.ops.clip(h, -0.5, 0.5)
        return self.out(h)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def fastgrad_subclass():
    keras.utils.set_random_seed(7)
    model = Regressor()
    model(np.zeros((1, 3), "float32"))
    return keras_fastgrad.fastgrad(model, accumulation_steps=2)


CASES = {
    "plain": plain,
    "mid_window": mid_window,
    "multitask_gradvac": multitask_gradvac,
    "sequential": sequential,
    "fastgrad_subclass": fastgrad_subclass,
}


def trained(case):
    model = CASES[case]()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x, y = fixture_data()
    if case == "multitask_gradvac":
        y = {"a": y, "b": -y}
    for i in range(3):
        rows = slice(2 * i, 2 * i + 2)
        target = {k: v[rows] for k, v in y.items()} if isinstance(y, dict) else y[rows]
        model.train_on_batch(x[rows], target)
    return model


if __name__ == "__main__":
    out = os.path.dirname(os.path.abspath(__file__))
    tag = sys.argv[1]
    for case in CASES:
        model = trained(case)
        stem = os.path.join(out, f"{case}_{tag}")
        model.save(stem + ".keras")
        model.save_weights(stem + ".weights.h5")
        store = {}
        model.fastgrad_step_state.save_own_variables(store)
        np.savez(
            stem + ".npz",
            **{f"weight_{i}": w for i, w in enumerate(model.get_weights())},
            **{f"state_{k}": np.asarray(v) for k, v in store.items()},
        )
        print("saved", case, type(model).__name__)
