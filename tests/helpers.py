"""Small models and data shared by the tests (both backends). References are
plain `keras.Model`s built with the same initial weights."""

import os

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import _compat

# FastGradModel refuses several replicas on Keras < 3.10 (a clear error,
# tested in test_compat.py); these tests need them.
needs_multi_replica_keras = pytest.mark.skipif(
    not _compat.MULTI_REPLICA_SUPPORTED,
    reason=f"several replicas need Keras >= 3.10 (installed: {keras.__version__})",
)


def data(n=12, features=3, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, outputs)).astype("float32")
    return x, y


def mlp(cls=keras.Model, features=3, outputs=1, seed=7, **options):
    """A two-layer MLP; the same `seed` gives the same initial weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(outputs, name="out")(hidden)
    return cls(inputs, out, **options)


def fast(**options):
    return mlp(keras_fastgrad.FastGradModel, **options)


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights()))


def same_start(a, b):
    assert max_weight_diff(a, b) == 0.0


def sparse(values, indices, rows):
    """An `IndexedSlices` of a `[rows, width]` table, and its dense numpy form."""
    values = np.asarray(values, np.float32)
    indices = np.asarray(indices, np.int64)
    dense = np.zeros((rows, values.shape[1]), np.float64)
    import tensorflow as tf  # (here: the JAX venv has no TensorFlow)

    np.add.at(dense, indices, values.astype(np.float64))
    slices = tf.IndexedSlices(
        tf.constant(values), tf.constant(indices), tf.constant([rows, values.shape[1]], tf.int64)
    )
    return slices, dense


def as_numpy(g):
    """Dense numpy value of a gradient (IndexedSlices densified by numpy)."""
    if type(g).__name__ == "IndexedSlices":  # (TensorFlow's; not imported on JAX)
        dense = np.zeros(g.dense_shape.numpy(), np.float64)
        np.add.at(dense, g.indices.numpy(), g.values.numpy().astype(np.float64))
        return dense
    return g.numpy()


def reference_gradients(model, loss_fn, variables=None):
    """The value of `loss_fn()` and its gradients, on any Keras backend.

    A reference independent of keras_fastgrad: `loss_fn` is a
    zero-argument closure that calls `model` (and, e.g., a Keras loss or
    `model.compute_loss`) and returns a scalar. TensorFlow: a
    `tf.GradientTape` over the variables' values. JAX: `jax.value_and_grad`
    over the values, mapped onto the variables by a `keras.StatelessScope`
    that collects the layers' `add_loss` terms (activity regularisers), so
    that `model.losses` holds them as on TensorFlow.

    Args:
        model: A built Keras model.
        loss_fn: Callable `() -> scalar tensor`.
        variables: The variables to differentiate for (defaults to
            `model.trainable_variables`).

    Returns:
        `(value, grads)`: the loss as a Python float and one
        numpy array per variable (dense; a sparse gradient densified, a
        variable the loss does not reach gets zeros).
    """
    variables = list(model.trainable_variables if variables is None else variables)
    if keras.backend.backend() == "jax":
        import jax

        def of_values(values):
            mapping = list(zip(variables, values))
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
                return loss_fn()

        value, grads = jax.value_and_grad(of_values)([v.value for v in variables])
        grads = [np.asarray(g) for g in grads]
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_fn()
        grads = tape.gradient(value, [v.value for v in variables])
        grads = [
            np.zeros(v.shape, v.dtype) if g is None else as_numpy(g)
            for v, g in zip(variables, grads)
        ]
    return float(value), grads


def np_agc(g, w, lam, eps=1e-3, unit_axis=-1):
    """Paper, eq. 3: G_i <- lam * max(||W_i||, eps) / ||G_i|| * G_i if that
    ratio is < 1, per unit i (`unit_axis`: the axis indexing the units;
    `None`: the whole tensor is one unit). Returns (clipped, n_clipped)."""
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if unit_axis is None or g.ndim <= 1:
        g_units, w_units = g[None], w[None]
    else:
        g_units, w_units = np.moveaxis(g, unit_axis, 0), np.moveaxis(w, unit_axis, 0)
    out, n_clipped = np.empty_like(g_units), 0
    for i in range(len(g_units)):
        g_norm = np.sqrt(np.sum(g_units[i] ** 2))
        max_norm = lam * max(np.sqrt(np.sum(w_units[i] ** 2)), eps)
        if g_norm > max_norm:
            out[i] = g_units[i] * (max_norm / g_norm)
            n_clipped += 1
        else:
            out[i] = g_units[i]
    if unit_axis is None or g.ndim <= 1:
        return out[0], n_clipped
    return np.moveaxis(out, 0, unit_axis), n_clipped


def between_middle(ratios):
    """A lambda halfway (geometrically) between the two middle ratios:
    half the units clipped, none at the boundary (where rounding decides
    whether a unit counts as clipped)."""
    r = np.sort(np.asarray(ratios, np.float64))
    k = len(r) // 2
    assert r[k - 1] < r[k]
    return float(np.sqrt(r[k - 1] * r[k]))


class TrainingBranch(keras.Model):
    """A subclass whose training call adds a branch (its own weights) that
    inference skips (built by its first training call unless called so)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.layers.Dense(6, activation="tanh")
        self.extra = keras.layers.Dense(6)
        self.head = keras.layers.Dense(1)

    def call(self, x, training=False):
        h = self.body(x)
        if training:
            h = h + 0.5 * self.extra(h)
        return self.head(h)


class FGTrainingBranch(keras_fastgrad.FastGradModel, TrainingBranch):
    pass


# The repository's root: scripts run in fresh processes import `tests` from it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 58  # `uneven_data`: batches of 16: 16, 16, 16, 10 (an uneven last batch)


def uneven_data(seed=0, d_in=8, d_out=3):
    """`ROWS` rows: batches of 16 end on an uneven one."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, d_in)).astype("float32")
    y = rng.normal(size=(ROWS, d_out)).astype("float32")
    return x, y


def mlp_16(cls=keras.Model, **options):
    """8 inputs, 16 tanh units, 3 outputs; the same initial weights each call."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def masked_gru(cls=keras.Model, sequences=False, **options):
    """Embedding(mask_zero=True) + GRU; `sequences`: one output a timestep,
    (7, 3), whose loss is masked (normalised by the valid timesteps)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
    h = keras.layers.GRU(6, return_sequences=sequences)(h)
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def sequential_16(cls=keras.Model, **options):
    """`mlp_16` as a `keras.Sequential` (`FastGradSequential` unless `cls`
    is `keras.Model`); the same initial weights each call."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    seq = keras.Sequential if cls is keras.Model else keras_fastgrad.FastGradSequential
    return seq(layers, **options)


def conv(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    return cls(inputs, keras.layers.Conv2D(1, 1)(h), **options)


def embedding(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 4)(inputs))
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def reference(build, x, y, epochs=2, batch_size=ROWS, sample_weight=None, loss="mse", **adam):
    """A plain `keras.Model` (same initial weights) trained on `batch_size`."""
    model = build(keras.Model)
    model.compile(keras.optimizers.Adam(1e-2, **adam), loss)
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model


def fastgrad_run(
    build,
    x,
    y,
    epochs=2,
    batch_size=16,
    sample_weight=None,
    loss="mse",
    optimizer=None,
    compile_kw=None,
    **options,
):
    """A `FastGradModel` of `build` trained on batches of `batch_size`: `(model, history)`."""
    model = build(keras_fastgrad.FastGradModel, **options)
    model.compile(optimizer or keras.optimizers.Adam(1e-2), loss, **(compile_kw or {}))
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model, history


def run_on_tensorflow(script, timeout=300):
    """Runs `script` in a fresh Python under `KERAS_BACKEND=tensorflow` (from
    the repository's root); fails the test with its stderr if it fails.
    Returns its stdout."""
    from tests.subprocesses import run_python

    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return run_python(script, env, ROOT, timeout)


class _Lazy:
    """A module imported at its first attribute read: test files that run on
    both backends name `tf` at the top, and the JAX venv has no TensorFlow
    (their TensorFlow tests are `tensorflow_only`, never run there)."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        import importlib

        if attribute.startswith(("_", "pytest")):  # pytest's probes while collecting
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


tf = _Lazy("tensorflow")
