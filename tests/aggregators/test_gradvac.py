"""GradVac (`aggregators/_gradvac.py`) against Wang et al. (2021), and its state in a model.

Backend-neutral: runs under TensorFlow and JAX (`TaskMerger`, TensorFlow's
merge, only there)."""

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    float64_on_jax,  # noqa: F401  (autouse)
    gradvac_np,
    gram_of,
    scaled_jacobian,
)
from tests.multitask_helpers import (
    build,
    compiled,
    make_data,
)


def test_gradvac_first_step_is_pcgrad():
    J = scaled_jacobian(3, seed=6, conflict=0.7)
    w = np.asarray(aggregators.GradVac().weights(gram_of(J)))
    np.testing.assert_allclose(w @ J, gradvac_np(J, np.zeros((3, 3)), 0.01)[0], rtol=1e-9)
    pc = aggregators.PCGrad().weights(gram_of(J), orders=[[1, 2], [0, 2], [0, 1]])
    np.testing.assert_allclose(w, np.asarray(pc), rtol=1e-9)


@pytest.mark.parametrize("num_tasks,beta", [(2, 0.5), (3, 0.3), (4, 0.01)])
def test_gradvac_follows_the_ema_over_steps(num_tasks, beta):
    # The step's use of the state: `weights_and_state`, then the new
    # targets assigned (TaskMerger and the JAX step do so when finite).
    agg = aggregators.GradVac(beta=beta)
    agg.build(num_tasks)
    targets = np.zeros((num_tasks, num_tasks))
    altered = 0
    for step in range(6):
        J = scaled_jacobian(num_tasks, seed=100 + step, conflict=0.3 * (step % 3))
        weights, (new,) = agg.weights_and_state(gram_of(J, "float32"))
        agg.state_variables[0].assign(new)
        expected, targets = gradvac_np(J, targets, beta)
        np.testing.assert_allclose(np.asarray(weights) @ J, expected, rtol=2e-4, atol=2e-5)
        state = keras.ops.convert_to_numpy(agg.state_variables[0])
        np.testing.assert_allclose(state, targets, rtol=1e-4, atol=1e-6)
        altered += not np.allclose(expected, J.sum(0))
    assert altered >= 3 and np.abs(targets).max() > 0.01


@pytest.mark.tensorflow_only(reason="TaskMerger is TensorFlow's merge (JAX: the fit test below)")
def test_gradvac_state_ignores_a_nonfinite_step():
    import tensorflow as tf

    from keras_fastgrad.multitask.merger import TaskMerger

    merger = TaskMerger("gradvac")
    J = scaled_jacobian(2, seed=1, conflict=0.8)
    head = tf.ones([3])
    merger.merge([[tf.constant(J[0], tf.float32), None], [tf.constant(J[1], tf.float32), head]])
    before = merger.aggregator.state_variables[0].numpy()
    assert np.abs(before).max() > 0
    J = scaled_jacobian(2, seed=2, conflict=0.9)  # finite shared gradients, a NaN head
    nan_head = tf.constant([1.0, np.nan, 1.0])
    per_task = [[tf.constant(J[0], tf.float32), None], [tf.constant(J[1], tf.float32), nan_head]]
    merged, info = merger.merge(per_task)
    assert np.isfinite(info["gram"].numpy()).all() and np.isfinite(merged[0].numpy()).all()
    np.testing.assert_array_equal(merger.aggregator.state_variables[0].numpy(), before)
    J[1, 3] = np.nan  # a NaN shared gradient
    merged, _ = merger.merge([[tf.constant(g, tf.float32), None] for g in J])
    assert not np.isfinite(merged[0].numpy()).all()
    np.testing.assert_array_equal(merger.aggregator.state_variables[0].numpy(), before)
    merger.merge(
        [[tf.constant(g, tf.float32), None] for g in scaled_jacobian(2, seed=3, conflict=0.9)]
    )
    assert not np.array_equal(merger.aggregator.state_variables[0].numpy(), before)


def test_gradvac_options_and_state_api():
    expected = r"`beta` must be a number >= 0.0 and <= 1.0. Received: beta=2"
    with pytest.raises(ValueError, match=expected):
        aggregators.GradVac(beta=2)
    agg = aggregators.get(aggregators.serialize(aggregators.GradVac(beta=0.2)))
    assert agg.beta == 0.2 and agg.state_variables == []
    agg.build(3)
    assert agg.state_variables[0].shape == (3, 3)
    w, (new,) = agg.weights_and_state(np.eye(3, dtype="float16") - 0.3)
    dtypes = [keras.backend.standardize_dtype(x.dtype) for x in (w, new)]
    assert dtypes == ["float16", "float32"]


def test_gradvac_state_restored_by_weights_file_and_plain_model_loads_it(tmp_path):
    model = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    x, y = make_data()
    model.train_on_batch(x, y)
    saved = np.asarray(model.multitask.state_variables[0])
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    fresh = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    fresh.load_weights(path)
    fresh.train_on_batch(x, y)  # builds the targets from the file, then moves them
    again = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    again.train_on_batch(x, y)  # from zeros: differs
    model.train_on_batch(x, y)
    np.testing.assert_allclose(
        np.asarray(fresh.multitask.state_variables[0]),
        np.asarray(model.multitask.state_variables[0]),
        rtol=1e-6,
        atol=1e-7,
    )
    assert not np.allclose(
        np.asarray(again.multitask.state_variables[0]),
        np.asarray(model.multitask.state_variables[0]),
    )
    assert np.abs(saved).max() > 0
    plain = build(keras.Model)
    plain.load_weights(path)
    for a, b in zip(plain.get_weights(), fresh.get_weights()):
        assert a.shape == b.shape


def test_gradvac_targets_survive_a_nan_batch_in_fit():
    model = compiled(build(multitask="gradvac", telemetry=True))
    x, y = make_data()
    model.train_on_batch(x, y)
    before = np.asarray(model.multitask.state_variables[0])
    x[0, 0] = np.nan
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 1.0
    np.testing.assert_array_equal(np.asarray(model.multitask.state_variables[0]), before)
    assert np.isfinite(before).all() and np.abs(before).max() > 0


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")
def test_gradvac_under_jax_jit_with_the_targets_threaded():
    # As the JAX step runs it: the targets passed in and out of `jax.jit`
    # (a `StatelessScope`); jit == eager == numpy over steps, 32-bit types.
    import jax

    agg = aggregators.GradVac(beta=0.3)
    agg.build(3)
    variable = agg.state_variables[0]

    @jax.jit
    def step(gram, targets):
        with keras.StatelessScope(state_mapping=[(variable, targets)]):
            return agg.weights_and_state(gram)

    with jax.enable_x64(False):
        targets = np.zeros((3, 3), np.float32)
        for seed in range(3):
            J = scaled_jacobian(3, seed=40 + seed, conflict=0.6)
            gram = gram_of(J, "float32")
            weights, (new,) = step(gram, targets)
            variable.assign(targets)
            eager_weights, (eager_new,) = agg.weights_and_state(gram)
            np.testing.assert_allclose(np.asarray(weights), np.asarray(eager_weights), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(new), np.asarray(eager_new), atol=1e-6)
            expected, expected_targets = gradvac_np(J, targets.astype(np.float64), 0.3)
            np.testing.assert_allclose(np.asarray(weights) @ J, expected, rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(np.asarray(new), expected_targets, atol=1e-5)
            targets = np.asarray(new)
    assert np.abs(targets).max() > 0.05
