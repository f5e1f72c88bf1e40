"""PCGrad (`aggregators/_pcgrad.py`) against Algorithm 1 of Yu et al. (2020), in numpy.

Backend-neutral: runs under TensorFlow and JAX."""

import itertools

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    compiled,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    merged_of,
    pcgrad_np,
    random_jacobian,
)

JAX_ONLY = pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit (JAX backend)")


def _orders(num_tasks, rng):
    others = [[j for j in range(num_tasks) if j != i] for i in range(num_tasks)]
    orders = np.array([rng.permutation(o) for o in others], np.int32)
    return orders.reshape(num_tasks, num_tasks - 1)


def _candidates(J):
    """Algorithm 1's merged gradient for every visiting order of `J`'s tasks."""
    num_tasks = len(J)
    others = [[j for j in range(num_tasks) if j != i] for i in range(num_tasks)]
    perms = itertools.product(*[itertools.permutations(o) for o in others])
    return [pcgrad_np(J, [list(p) for p in orders]) for orders in perms]


def _closest(w, J, candidates):
    """The index of the candidate `w^T J` is (relative error <= 1e-4)."""
    merged = merged_of(w, J)
    dists = [np.max(np.abs(merged - c)) / np.max(np.abs(c)) for c in candidates]
    assert min(dists) < 1e-4
    return int(np.argmin(dists))


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_pcgrad_matches_algorithm1(num_tasks):
    J = random_jacobian(num_tasks, seed=num_tasks, conflict=0.6)
    assert (J @ J.T < 0).any()
    rng = np.random.default_rng(0)
    for _ in range(3):
        orders = _orders(num_tasks, rng)
        w = aggregators.PCGrad().weights(gram_of(J), orders=orders)
        expected = pcgrad_np(J, orders)
        np.testing.assert_allclose(merged_of(w, J), expected, rtol=1e-5, atol=1e-8)


@pytest.mark.tensorflow_only(reason="tf.function(jit_compile=True) moves the SeedGenerator")
def test_pcgrad_random_order_under_xla():
    J = random_jacobian(3, seed=7, conflict=0.7)
    candidates = _candidates(J)
    assert len({tuple(np.round(c, 6)) for c in candidates}) > 1  # the order matters
    fn = compiled(aggregators.PCGrad(seed=1).weights)
    gram = gram_of(J, "float32")
    results = [_closest(fn(gram), J, candidates) for _ in range(20)]
    assert len(set(results)) >= 2


def test_pcgrad_seed_makes_its_orders_reproducible():
    # The same seed, the same sequence of visiting orders (under XLA too on
    # TensorFlow; eager on JAX, whose step threads the generator's state:
    # test_pcgrad_under_jax_jit_with_the_seed_state_threaded); each call
    # draws fresh ones.
    gram = gram_of(random_jacobian(4, seed=3, conflict=0.7), "float32")
    runs = []
    for _ in range(2):
        fn = aggregators.PCGrad(seed=5).weights
        fn = fn if keras.backend.backend() == "jax" else compiled(fn)
        runs.append([np.asarray(fn(gram)) for _ in range(6)])
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
    w = np.asarray(aggregators.PCGrad().weights(gram_of(J, "float32"), orders=orders))
    assert np.all(np.isfinite(w))
    expected = pcgrad_np(J, [[2], [0, 2], [0]])  # projecting on 0 is a no-op
    np.testing.assert_allclose(merged_of(w, J), expected, rtol=1e-4, atol=1e-5)


def test_pcgrad_orders_of_the_wrong_shape_are_refused():
    expected = r"`orders` must have shape \(3, 2\) for 3 tasks. Received: orders.shape=\(3, 1\)"
    with pytest.raises(ValueError, match=expected):
        aggregators.PCGrad().weights(np.eye(3), orders=[[1], [0], [0]])


@JAX_ONLY
def test_pcgrad_under_jax_jit_with_the_seed_state_threaded():
    # As the JAX step runs it: the generator's state passed in and out of
    # `jax.jit` (a `StatelessScope`). Fixed orders: jit == eager == numpy;
    # drawn orders: Algorithm 1 for some order, the same sequence as eager
    # calls of an aggregator with the same seed, fresh orders per call.
    import jax

    J = random_jacobian(3, seed=7, conflict=0.7)
    with jax.enable_x64(False):  # the JAX step's default 32-bit types
        gram = gram_of(J, "float32")
        orders = np.array([[2, 1], [0, 2], [1, 0]], np.int32)
        agg = aggregators.PCGrad(seed=4)
        fixed = jax.jit(lambda g, o: agg.weights(g, orders=o))(gram, orders)
        eager = agg.weights(gram, orders=orders)
        np.testing.assert_allclose(np.asarray(fixed), np.asarray(eager), rtol=1e-6)
        np.testing.assert_allclose(merged_of(fixed, J), pcgrad_np(J, orders), rtol=1e-4)

        state = agg.seed_generator.state

        @jax.jit
        def step(gram, seed_state):
            with keras.StatelessScope(state_mapping=[(state, seed_state)]) as scope:
                weights = agg.weights(gram)
            return weights, scope.get_current_value(state)

        seed_state = state.value
        reference = aggregators.PCGrad(seed=4)  # eager, its own generator
        candidates, picked = _candidates(J), []
        for _ in range(8):
            w, seed_state = step(gram, seed_state)
            np.testing.assert_allclose(
                np.asarray(w), np.asarray(reference.weights(gram)), rtol=1e-6
            )
            picked.append(_closest(w, J, candidates))
    assert len(set(picked)) >= 2
