"""PCGrad (`aggregators/_pcgrad.py`) against Algorithm 1 of Yu et al. (2020), in numpy."""

import itertools

import numpy as np
import pytest
import tensorflow as tf  # noqa: E402
from aggregator_references import gram_of, merged_of, pcgrad_np, random_jacobian

from keras_fastgrad import aggregators  # noqa: E402


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_pcgrad_matches_algorithm1(num_tasks):
    J = random_jacobian(num_tasks, seed=num_tasks, conflict=0.6)
    assert (J @ J.T < 0).any()
    rng = np.random.default_rng(0)
    for _ in range(3):
        others = [[j for j in range(num_tasks) if j != i] for i in range(num_tasks)]
        orders = np.array([rng.permutation(o) for o in others], np.int32)
        orders = orders.reshape(num_tasks, num_tasks - 1)
        w = aggregators.PCGrad().weights(gram_of(J), orders=orders)
        expected = pcgrad_np(J, orders)
        np.testing.assert_allclose(merged_of(w, J), expected, rtol=1e-5, atol=1e-8)


def test_pcgrad_random_order_under_xla():
    J = random_jacobian(3, seed=7, conflict=0.7)
    others = [[j for j in range(3) if j != i] for i in range(3)]
    candidates = [
        pcgrad_np(J, [list(p) for p in perms])
        for perms in itertools.product(*[itertools.permutations(o) for o in others])
    ]
    assert len({tuple(np.round(c, 6)) for c in candidates}) > 1  # the order matters
    agg = aggregators.PCGrad(seed=1)
    fn = tf.function(agg.weights, jit_compile=True)
    gram = gram_of(J, tf.float32)
    results = []
    for _ in range(20):
        merged = merged_of(fn(gram).numpy(), J)
        dists = [np.max(np.abs(merged - c)) / np.max(np.abs(c)) for c in candidates]
        assert min(dists) < 1e-4
        results.append(int(np.argmin(dists)))
    assert len(set(results)) >= 2


def test_pcgrad_seed_makes_its_orders_reproducible():
    # The same seed, the same sequence of visiting orders (under XLA too);
    # each call draws fresh ones.
    gram = gram_of(random_jacobian(4, seed=3, conflict=0.7), tf.float32)
    runs = []
    for _ in range(2):
        fn = tf.function(aggregators.PCGrad(seed=5).weights, jit_compile=True)
        runs.append([fn(gram).numpy() for _ in range(6)])
    np.testing.assert_array_equal(np.array(runs[0]), np.array(runs[1]))
    assert len({tuple(w.round(6)) for w in runs[0]}) > 1


def test_pcgrad_tug_of_war():
    J = np.array([[-10.0, 0.0], [1.0, -1.0]])
    total = J.sum(0)
    assert total @ J[1] < 0  # the sum increases task 2's loss
    pc = merged_of(aggregators.get("pcgrad").weights(gram_of(J)), J)
    assert pc @ J[0] > 0 and pc @ J[1] > 0


def test_pcgrad_zero_gradient_is_finite():
    J = random_jacobian(3, seed=1, conflict=0.8)
    J[1] = 0.0
    orders = [[1, 2], [0, 2], [0, 1]]
    w = aggregators.PCGrad().weights(gram_of(J, tf.float32), orders=orders)
    assert np.all(np.isfinite(w.numpy()))
    expected = pcgrad_np(J, [[2], [0, 2], [0]])  # projecting on 0 is a no-op
    np.testing.assert_allclose(merged_of(w, J), expected, rtol=1e-4, atol=1e-5)
