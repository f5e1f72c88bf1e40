"""Multi-task merging on models that are not MLPs.

- `micro_batches` + `multitask` on a masked sequence model (Embedding with
  `mask_zero`, GRU, a per-timestep loss per task) equals the un-split
  multi-task step (itself checked against numpy in test_merger.py).
- `multitask_space="features"` on a Conv2D trunk with per-pixel losses and
  on the masked GRU: the update equals `sum_t w_t dL_t/dtheta` on the trunk
  (the heads' plain gradients), with `w` the exact MGDA weights (numpy) of
  the Gram matrix of `dL_t/dZ`, all computed with Keras layers called
  directly and `helpers.reference_gradients` (a tape on TensorFlow,
  `jax.value_and_grad` on JAX), the masked means written out by hand.
  Runs on both backends.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_fastgrad
from tests.aggregator_references import mgda_np
from tests.helpers import reference_gradients
from tests.multitask_helpers import (
    build,
    flat,
    make_data,
    reference_model,
    shared_mask,
    task_gradients,
)

LR = 0.05


# ------------------------------------------------------------------ models
def masked_gru(mask_zero=True, **options):
    """Tokens -> Embedding(mask_zero) -> GRU (sequences) -> two
    per-timestep heads; the padding (token 0) is masked out of the loss."""
    keras.utils.set_random_seed(11)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 5, mask_zero=mask_zero, name="embed")(tokens)
    z = keras.layers.GRU(4, return_sequences=True, name="gru")(h)
    heads = {t: keras.layers.Dense(1, name=t)(z) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(tokens, heads, **options)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"a": "mse", "b": "mse"})
    return model


def sequence_data(n, seed=0, sign=-1.0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 12, size=(n, 6)).astype("int32")
    lengths = rng.integers(2, 7, size=n)
    for i, length in enumerate(lengths):
        x[i, length:] = 0  # padding
    base = np.cumsum(x, axis=1)[..., None].astype("float32") / 20.0
    y = {
        "a": base + 0.1 * rng.normal(size=base.shape).astype("float32"),
        "b": sign * 2.0 * base + 0.1 * rng.normal(size=base.shape).astype("float32"),
    }
    return x, y


def conv_net(**options):
    """8x8 images -> two Conv2D (the trunk) -> a 1x1 Conv2D per task: a
    per-pixel regression each."""
    keras.utils.set_random_seed(3)
    images = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="conv1")(images)
    z = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="conv2")(h)
    heads = {t: keras.layers.Conv2D(1, 1, name=t)(z) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(images, heads, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss={"a": "mse", "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.7},
    )
    return model


def image_data(model, n=6, seed=1):
    """Targets that make the tasks conflict over `Z`: near the initial
    weights `dL_t/dZ ~ -y_t K_t`, so `y_b`'s sign opposes that of
    `K_a . K_b`."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 2)).astype("float32")
    base = x.sum(axis=-1, keepdims=True)
    k_a, k_b = (model.get_layer(t).kernel.numpy().ravel() for t in ("a", "b"))
    sign = -np.sign(k_a @ k_b)
    return x, {
        "a": base + 0.2 * rng.normal(size=base.shape).astype("float32"),
        "b": sign * 1.5 * base + 0.2 * rng.normal(size=base.shape).astype("float32"),
    }


def weights(model):
    return {v.path: v.numpy().astype("float64") for v in model.trainable_variables}


# ------------------------------------------- micro_batches + multitask
@pytest.mark.parametrize("method", ["pcgrad", "mgda"])
def test_micro_batches_with_multitask_on_a_gru_equal_the_unsplit_step(method):
    # Batches of 7 in 3 slices (3, 3, 1 + 2 padded rows); per-timestep
    # losses, sample weights. (No mask: with masks on several outputs no
    # single weight per slice is exact, see the next test.)
    x, y = sequence_data(14)
    steps = np.linspace(0.5, 2.0, 14 * 6).reshape(14, 6).astype("float32")
    w = {"a": steps, "b": steps[::-1].copy()}  # per timestep, per output
    initial = weights(masked_gru(mask_zero=False))
    ref = masked_gru(mask_zero=False, multitask=method)
    model = masked_gru(mask_zero=False, multitask=method, micro_batches=3)
    h_ref = ref.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    expected, got = weights(ref), weights(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert np.abs(got[path] - initial[path]).max() > 1e-5, f"{path} did not move"
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_micro_batches_under_a_sum_reduction_merge_the_batchs_gram():
    # `reduction="sum"`: each slice's share is 1 and the slices' summed
    # task gradients are the batch's own: the Gram matrix the aggregator
    # weighs (and the task telemetry) is the batch's, not divided by the
    # slices' count squared. Reference: `n` times each task's mean-loss
    # gradient over the trunk (`multitask_helpers.task_gradients`).
    x, y = make_data(n=8)
    model = build(multitask="mgda", telemetry=True, micro_batches=2)
    sums = {t: keras.losses.MeanSquaredError(reduction="sum") for t in "ab"}
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=sums)
    grads = task_gradients(reference_model(model), x, y)
    norms = [8.0 * np.linalg.norm(flat(grads[t], shared_mask(model))) for t in "ab"]
    logs = model.train_on_batch(x, y, return_dict=True)
    got = [logs["task_grad_norm/a"], logs["task_grad_norm/b"]]
    np.testing.assert_allclose(got, norms, rtol=1e-5)


def test_micro_batches_with_masks_on_several_outputs_warn_that_rows_weigh():
    # The documented limit (`keras_fastgrad.step.weighting`): each output's
    # masked normaliser differs from its rows, and one weight per slice
    # cannot be exact for all outputs; the step says so.
    x, y = sequence_data(14)
    model = masked_gru(multitask="pcgrad", micro_batches=3)
    with pytest.warns(UserWarning, match="weighted by their number of rows"):
        model.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)


# ------------------------------------------------------- features space
def _features_reference(trunk, trunk_vars, heads, x, y, loss_fns):
    """(trunk gradients per task, head gradients, Gram of dL_t/dZ) from the
    model's own layers called directly (`z = trunk(x)`, `head(z)`) before
    the step, each task's gradients apart (`helpers.reference_gradients`:
    a tape on TensorFlow, `jax.value_and_grad` on JAX); `dL_t/dZ` as the
    gradient for a variable holding `Z`."""
    per_task, head_grads, dz = [], {}, []
    z = keras.Variable(keras.ops.convert_to_numpy(trunk(x)))  # (trainable: a tape watches it)
    for t, head in heads.items():
        _, (g_z, *g_head) = reference_gradients(
            head,
            lambda t=t, head=head: loss_fns[t](y[t], head(z.value)),
            [z, *head.trainable_variables],
        )
        dz.append(g_z.astype("float64").ravel())
        for v, g in zip(head.trainable_variables, g_head):
            head_grads[v.path] = g.astype("float64")
        _, g_trunk = reference_gradients(
            head, lambda t=t, head=head: loss_fns[t](y[t], head(trunk(x))), trunk_vars
        )
        per_task.append([g.astype("float64") for g in g_trunk])
    dz = np.stack(dz)
    return per_task, head_grads, dz @ dz.T


def _check_features_step(model, trunk, trunk_vars, heads, x, y, loss_fns):
    per_task, head_grads, gram = _features_reference(trunk, trunk_vars, heads, x, y, loss_fns)
    assert gram[0, 1] < 0, "the test needs conflicting tasks"
    w = mgda_np(gram)
    assert 0.05 < w[0] < 0.95, "MGDA weights at a vertex would not test the merge"
    before = weights(model)
    model.train_on_batch(x, y)
    after = weights(model)
    for k, v in enumerate(trunk_vars):
        expected = before[v.path] - LR * sum(wt * g[k] for wt, g in zip(w, per_task))
        np.testing.assert_allclose(after[v.path], expected, rtol=1e-4, atol=1e-6, err_msg=v.path)
    for path, g in head_grads.items():
        np.testing.assert_allclose(
            after[path], before[path] - LR * g, rtol=1e-4, atol=1e-6, err_msg=path
        )


def test_features_space_on_a_conv_trunk_with_per_pixel_losses():
    model = conv_net(multitask="mgda", multitask_space="features")
    x, y = image_data(model)
    conv1, conv2 = model.get_layer("conv1"), model.get_layer("conv2")
    heads = {t: model.get_layer(t) for t in ("a", "b")}
    scale = {"a": 1.0, "b": 0.7}
    # "mse" per pixel (mean over the channel axis), then the mean over
    # batch, height and width; times the loss weight.
    loss_fns = {t: (lambda yt, p, t=t: scale[t] * ops.mean(ops.square(p - yt))) for t in heads}
    _check_features_step(
        model,
        lambda images: conv2(conv1(images)),
        conv1.trainable_variables + conv2.trainable_variables,
        heads,
        x,
        y,
        loss_fns,
    )


def test_features_space_on_a_masked_gru():
    model = masked_gru(multitask="mgda", multitask_space="features")
    # Conflicting tasks over `Z` (see `image_data`).
    k_a, k_b = (model.get_layer(t).kernel.numpy().ravel() for t in ("a", "b"))
    x, y = sequence_data(8, seed=4, sign=-np.sign(k_a @ k_b))
    embed, gru = model.get_layer("embed"), model.get_layer("gru")
    heads = {t: model.get_layer(t) for t in ("a", "b")}
    mask = (x != 0).astype("float32")

    def masked_mse(yt, p):
        """Mean of the per-timestep squared error over the valid steps."""
        per_step = ops.mean(ops.square(p - yt), axis=-1)
        return ops.sum(per_step * mask) / np.sum(mask)

    _check_features_step(
        model,
        lambda tokens: gru(embed(tokens), mask=ops.not_equal(tokens, 0)),  # the padding mask
        embed.trainable_variables + gru.trainable_variables,
        heads,
        x,
        y,
        {t: masked_mse for t in heads},
    )
