"""The multi-task models, data and references that the merger's tests
(`multitask/test_merger.py`), the features-space tests
(`multitask/test_feature_space.py`), the aggregators' model tests and the
MirroredStrategy runner (`mirrored_multitask.py`) share."""

import keras
import numpy as np

import keras_fastgrad

LR = 0.1


TASKS = ("a", "b", "c")


# ------------------------------------------------------------------ models
def build(cls=keras_fastgrad.FastGradModel, num_tasks=2, regularizer=None, **options):
    """Input (3,) -> shared Dense(4, tanh) "trunk" -> one Dense(1) head per task."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="trunk", kernel_regularizer=regularizer)(
        inputs
    )
    outputs = {t: keras.layers.Dense(1, name=t)(hidden) for t in TASKS[:num_tasks]}
    return cls(inputs, outputs, **options)


def compiled(model, loss_weights=None, **kwargs):
    # An unbuilt subclassed model has no output names yet: tasks "a", "b".
    names = list(getattr(model, "output_names", None) or TASKS[:2])
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss={t: "mse" for t in names},
        loss_weights=loss_weights,
        **kwargs,
    )
    return model


def make_data(n=8, num_tasks=2, signs=(1.0, -3.0, 2.0), seed=0, noise=0.0):
    """Targets of opposite signs: the tasks pull the trunk apart (plus
    `noise` times a normal draw per target, when `noise` is not 0)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    base = x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 1.0
    y = {
        t: (s * base + (noise * rng.normal(size=base.shape) if noise else 0.0)).astype("float32")
        for t, s in zip(TASKS[:num_tasks], signs)
    }
    return x, y


def conflicting(model):
    """`build()`'s two-task `model` with weights of a fixed numpy draw (the
    same on every backend, whose initialisers draw differently) under which
    the tasks conflict over the trunk and over `Z` on `make_data()` (also
    with `n=6`, `noise=0.3`, loss weights 1 and 0.4)."""
    rng = np.random.default_rng(0)
    paths = ["trunk/kernel", "trunk/bias", "a/kernel", "a/bias", "b/kernel", "b/bias"]
    values = {}
    for p in paths:
        layer, name = p.split("/")
        shape = getattr(model.get_layer(layer), name).shape
        values[p] = rng.normal(scale=0.5, size=shape).astype("float32")
    for layer in ("trunk", "a", "b"):
        model.get_layer(layer).set_weights([values[f"{layer}/kernel"], values[f"{layer}/bias"]])
    return model


def reference_model(model):
    """A plain keras.Model with the same architecture and weights."""
    ref = build(keras.Model, num_tasks=len(model.output_names))
    ref.set_weights(model.get_weights())
    return ref


def task_gradients(ref, x, y, loss_weights=None):
    """{task: [np gradient per trainable variable]}, one tape per task
    (on JAX: `jax.grad` of each task's loss on the state's values)."""
    if keras.backend.backend() == "jax":
        return _jax_task_gradients(ref, x, y, loss_weights)
    import tensorflow as tf

    grads = {}
    for t in y:
        with tf.GradientTape() as tape:
            pred = ref(x)[t]
            w = 1.0 if loss_weights is None else loss_weights[t]
            loss = w * tf.reduce_mean(tf.square(pred - y[t]))
        g = tape.gradient(loss, ref.trainable_variables)
        grads[t] = [
            np.zeros(v.shape, "float64") if gi is None else gi.numpy().astype("float64")
            for v, gi in zip(ref.trainable_variables, g)
        ]
    return grads


def _jax_task_gradients(ref, x, y, loss_weights=None):
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in ref.trainable_variables]
    non_trainable = [v.value for v in ref.non_trainable_variables]

    def loss(values, t):
        pred = ref.stateless_call(values, non_trainable, x)[0][t]
        w = 1.0 if loss_weights is None else loss_weights[t]
        return w * jnp.mean(jnp.square(pred - y[t]))

    return {t: [np.asarray(g).astype("float64") for g in jax.grad(loss)(trainable, t)] for t in y}


def shared_mask(model):
    return [v.path.startswith("trunk") for v in model.trainable_variables]


def flat(grads, mask):
    return np.concatenate([g.ravel() for g, m in zip(grads, mask) if m])


def unflat(vector, like, mask):
    out, i = [], 0
    for g, m in zip(like, mask):
        if m:
            out.append(vector[i : i + g.size].reshape(g.shape))
            i += g.size
        else:
            out.append(None)
    return out


def expected_gradient(model, grads, merged_shared):
    """Shared variables: the merged vector; heads: their task's gradient."""
    mask = shared_mask(model)
    like = next(iter(grads.values()))
    shared = unflat(merged_shared, like, mask)
    out = []
    for k, v in enumerate(model.trainable_variables):
        if mask[k]:
            out.append(shared[k])
        else:
            out.append(grads[v.path.split("/")[0]][k])
    return out


def weights_of(model):
    return [v.numpy().astype("float64") for v in model.trainable_variables]


def assert_step(before, after, gradient, rtol=1e-5, atol=1e-6):
    for b, a, g in zip(before, after, gradient):
        np.testing.assert_allclose(a, b - LR * g, rtol=rtol, atol=atol)
