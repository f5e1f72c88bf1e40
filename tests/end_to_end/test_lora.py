"""LoRA on a KerasHub backbone, on both backends: a tiny BERT backbone
built from its constructor (no preset is downloaded) under a dense head, its
`enable_lora(rank=2)`, wrapped by `keras_fastgrad.fastgrad(model,
accumulation_steps=2)`. The window holds a sum for each trainable variable
only (the LoRA factors and the classifier's head, not the frozen
backbone's kernels) and training equals a plain `keras.Model` on the big
batches; `enable_lora` called mid-window follows the documented rule for
variables that start and stop training (docs/concepts/exactness.md, "The
trainable set changes mid-window"), worked out by hand from a plain
model's gradients.

KerasHub is installed for the TensorFlow full tier (README, "Tests") and
by docs/jax.md's install line for the JAX run."""

import keras
import numpy as np
import pytest

from keras_fastgrad import fastgrad
from tests.helpers import max_weight_diff, reference_gradients

ROWS, SEQ, VOCAB, CLASSES = 16, 8, 50, 3


def tiny_bert_classifier():
    """A 1-layer, 8-wide `BertBackbone` (named `"bert"`) under a dense
    head on its pooled output, as a functional `keras.Model` (KerasHub's
    own tasks fit through `tf.data` or Grain); the same initial weights
    each call (LoRA's factors included, when enabled later). The kernels
    and embeddings scaled from BERT's standard deviation 0.02 to 0.5: at
    0.02 the attention's gradients on a model this small are at float32's
    rounding."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=SEQ,
        dropout=0.0,
        name="bert",
    )
    for v in backbone.weights:
        if v.path.endswith(("kernel", "embeddings")):
            v.assign(v * 25.0)
    inputs = backbone.input
    logits = keras.layers.Dense(CLASSES, name="logits")(backbone(inputs)["pooled_output"])
    return keras.Model(inputs, logits)


def batch(rows=ROWS):
    rng = np.random.default_rng(1)
    x = {
        "token_ids": rng.integers(1, VOCAB, size=(rows, SEQ)).astype("int32"),
        "segment_ids": np.zeros((rows, SEQ), "int32"),
        "padding_mask": np.ones((rows, SEQ), "int32"),
    }
    return x, rng.integers(0, CLASSES, size=(rows,))


def rows(x, start, stop):
    return {k: v[start:stop] for k, v in x.items()}


def with_lora(model):
    keras.utils.set_random_seed(4)  # (LoRA's `a` factors: the same each call)
    model.get_layer("bert").enable_lora(rank=2)
    return model


def compile(model, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def test_lora_windows_hold_the_trainable_weights_only_and_equal_the_big_batch():
    x, y = batch()
    ref = with_lora(tiny_bert_classifier())
    model = fastgrad(with_lora(tiny_bert_classifier()), accumulation_steps=2)
    assert max_weight_diff(ref, model) == 0.0
    # The query and value projections of the one attention layer: each its
    # `a` (8, 2, 2) and `b` (2, 4) (2 heads of 4) and its bias (Keras'
    # `enable_lora` freezes the kernel only); the head's kernel and bias.
    lora = [v for v in model.trainable_variables if "lora" in v.path]
    assert sorted(tuple(v.shape) for v in lora) == [(2, 4)] * 2 + [(8, 2, 2)] * 2
    others = sorted("/".join(v.path.split("/")[-2:]) for v in model.trainable_variables)
    assert [p for p in others if "lora" not in p] == [
        "logits/bias",
        "logits/kernel",
        "query/bias",
        "value/bias",
    ], others
    assert len(model.non_trainable_variables) > 8  # the frozen backbone
    start = {v.path: v.numpy() for v in ref.trainable_variables}
    for m in (ref, model):
        compile(m, keras.optimizers.Adam(1e-2))  # (BERT's gradients here are ~1e-7: Adam moves all)
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    # The window: one sum per trainable variable, of its shape.
    sums = model.fastgrad_step_state.accumulator.sums
    assert [tuple(s.shape) for s in sums] == [tuple(v.shape) for v in model.trainable_variables]
    assert model.telemetry_counters()["updates"] == 4.0
    assert max_weight_diff(ref, model) < 1e-5
    # Each trainable variable moved as the reference's (`b` from its
    # zeros, then `a`), to 1e-3 of its move; the frozen ones did not.
    for v, want in zip(model.trainable_variables, ref.trainable_variables):
        moved = want.numpy() - start[v.path]
        assert np.max(np.abs(moved)) > 1e-3, v.path
        np.testing.assert_allclose(
            v.numpy() - start[v.path], moved, atol=1e-3 * np.max(np.abs(moved)), err_msg=v.path
        )
    for v, want in zip(model.non_trainable_variables, ref.non_trainable_variables):
        np.testing.assert_array_equal(v.numpy(), want.numpy(), err_msg=v.path)


def test_enable_lora_mid_window_follows_the_rule_for_variables_that_start_training():
    # Windows of 3 micro-batches of 4 rows. Two micro-batches with every
    # weight training; then `enable_lora` (the backbone frozen, its LoRA
    # factors new) and `compile`; then the window's last micro-batch. The
    # rule: the head keeps training, so it gets the big batch's gradient
    # (LoRA's `b` starts at zero, so the forward pass is unchanged); the
    # frozen backbone's pending gradient is discarded (it does not move);
    # the LoRA factors start training, so they get the last micro-batch's
    # gradient weighted by its share of the window (4 of 12 rows). By
    # hand with a plain model's gradients, SGD without momentum.
    x, y = batch(12)
    lr = 1.0
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = with_lora(tiny_bert_classifier())
    _, big = reference_gradients(ref, lambda: loss(y, ref(x)))
    _, last = reference_gradients(ref, lambda: loss(y[8:], ref(rows(x, 8, 12))))
    start, step = {}, {}
    for v, g_big, g_last in zip(ref.trainable_variables, big, last):
        g = g_last * (4 / 12) if "lora" in v.path else g_big
        start[v.path], step[v.path] = v.numpy(), -lr * np.asarray(g)
    frozen = {v.path: v.numpy() for v in ref.non_trainable_variables}

    model = fastgrad(tiny_bert_classifier(), accumulation_steps=3)
    compile(model, keras.optimizers.SGD(lr))
    model.train_on_batch(rows(x, 0, 4), y[:4])
    model.train_on_batch(rows(x, 4, 8), y[4:8])
    assert int(model.optimizer.iterations.numpy()) == 0  # the window is pending
    with_lora(model)
    compile(model, keras.optimizers.SGD(lr))
    model.train_on_batch(rows(x, 8, 12), y[8:])
    assert int(model.optimizer.iterations.numpy()) == 1
    assert model.telemetry_counters()["updates"] == 1.0
    sums = model.fastgrad_step_state.accumulator.sums
    assert [tuple(s.shape) for s in sums] == [tuple(v.shape) for v in model.trainable_variables]
    assert sorted(v.path for v in model.trainable_variables) == sorted(step)
    # Each update to 1e-4 of its size (`a`'s is 0: `b` was 0).
    for v in model.trainable_variables:
        want = step[v.path]
        np.testing.assert_allclose(
            v.numpy() - start[v.path], want, atol=1e-4 * np.max(np.abs(want)) + 1e-9, err_msg=v.path
        )
    assert sum(np.max(np.abs(s)) > 0 for p, s in step.items() if "lora" in p) == 2  # the `b`s
    for v in model.non_trainable_variables:
        if v.path in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.path], err_msg=v.path)
