"""The registry (`aggregators/__init__.py`: `get`, `serialize`, `NAMES`,
`gram_telemetry`) and what every aggregator shares: dtypes, XLA, degenerate
and non-finite Grams, option checks."""

import itertools

import keras  # noqa: E402
import numpy as np
import pytest
import tensorflow as tf  # noqa: E402
from aggregator_references import NEW, gram_of, random_jacobian, scaled_jacobian

from keras_fastgrad import aggregators  # noqa: E402


def _nan_gram():
    J = random_jacobian(3, seed=5, conflict=0.5)
    J[1, 7] = np.nan  # one NaN in one task's gradient
    return tf.constant(J @ J.T, tf.float32)


def _call(agg, gram):
    if isinstance(agg, aggregators.PCGrad):  # fixed visiting orders
        t = gram.shape[0]
        orders = [[j for j in range(t) if j != i] for i in range(t)]
        return agg.weights(gram, orders=tf.constant(orders, tf.int32, shape=(t, t - 1)))
    return agg.weights(gram)


@pytest.mark.parametrize("name", ["aligned", "imtl"])
@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_nonfinite_gram_gives_nonfinite_weights_without_error(name, mode):
    agg = aggregators.get(name)
    fn = {
        "eager": agg.weights,
        "function": tf.function(agg.weights),
        "xla": tf.function(agg.weights, jit_compile=True),
    }[mode]
    gram = _nan_gram()
    assert not np.all(np.isfinite(gram.numpy()))
    w = fn(gram).numpy()  # `eigh` on a NaN Gram would raise on CPU
    assert w.shape == (3,) and not np.any(np.isfinite(w))
    inf_gram = tf.constant([[np.inf, 0.0], [0.0, 1.0]], tf.float64)
    assert not np.any(np.isfinite(fn(inf_gram).numpy()))


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_xla_and_graph_match_eager_and_keep_dtype(name):
    J = random_jacobian(3, seed=50, conflict=0.5)
    agg = aggregators.get(name)
    gram32 = gram_of(J, tf.float32)
    eager = _call(agg, gram32)
    xla = tf.function(lambda g: _call(agg, g), jit_compile=True)(gram32)
    graph = tf.function(lambda g: _call(agg, g))(gram32)
    assert eager.dtype == tf.float32 and xla.dtype == tf.float32
    assert eager.shape == (3,)
    np.testing.assert_allclose(xla.numpy(), eager.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(graph.numpy(), eager.numpy(), rtol=1e-4, atol=1e-5)
    assert _call(agg, tf.cast(gram32, tf.float16)).dtype == tf.float16
    w64 = _call(agg, gram_of(J))
    assert w64.dtype == tf.float64
    np.testing.assert_allclose(w64.numpy(), eager.numpy(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_single_task_and_zero_gram_are_finite(name):
    agg = aggregators.get(name)
    assert np.all(np.isfinite(_call(agg, tf.constant([[4.0]])).numpy()))
    assert np.all(np.isfinite(_call(agg, tf.zeros([3, 3])).numpy()))


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_get_serialize_round_trip(name):
    agg = aggregators.get(name)
    assert agg.name == name and aggregators.get(agg) is agg
    config = aggregators.serialize(agg)
    clone = aggregators.get(config)
    assert type(clone) is type(agg) and clone.get_config() == agg.get_config()
    assert type(keras.saving.deserialize_keras_object(config)) is type(agg)


def test_get_keeps_arguments_and_errors():
    clone = aggregators.get(aggregators.serialize(aggregators.CAGrad(c=0.2, rescale=0)))
    assert clone.get_config() == {"c": 0.2, "rescale": 0, "max_iter": 1000}
    assert aggregators.get(None) is None
    assert sorted(aggregators.NAMES) == list(aggregators.NAMES)
    expected = (
        r"`multitask` must be one of \['aligned', 'cagrad', 'config', 'dualproj', "
        r"'gradvac', 'imtl', 'mean', 'mgda', 'nashmtl', 'pcgrad', 'sum', 'upgrad'\] "
        r"or an Aggregator instance\. Received: multitask='foo'"
    )
    with pytest.raises(ValueError, match=expected):
        aggregators.get("foo")
    with pytest.raises(ValueError, match="`c` must be"):
        aggregators.CAGrad(c=-1.0)
    with pytest.raises(ValueError, match=r"`gram` must be a square matrix"):
        aggregators.Mean().weights(tf.zeros([2, 3]))


def test_gram_telemetry():
    J = random_jacobian(4, seed=60, conflict=0.5)
    J[3] = 0.0
    t = aggregators.gram_telemetry(gram_of(J))
    norms = np.linalg.norm(J, axis=1)
    np.testing.assert_allclose(t["norms"].numpy(), norms, rtol=1e-10)
    safe = np.where(norms > 0, norms, 1.0)
    cosine = np.where(np.outer(norms, norms) > 0, (J @ J.T) / np.outer(safe, safe), 0.0)
    np.testing.assert_allclose(t["cosine"].numpy(), cosine, rtol=1e-10, atol=1e-12)
    G = J @ J.T
    pairs = itertools.combinations(range(4), 2)
    assert int(t["num_conflicts"]) == sum(G[i, j] < 0 for i, j in pairs)


@pytest.mark.parametrize("name", NEW)
def test_graph_and_xla_match_eager_on_conflicting_tasks(name):
    J = scaled_jacobian(4, seed=11, conflict=0.7)
    agg = aggregators.get(name)
    for dtype, rtol in ((tf.float64, 1e-9), (tf.float32, 1e-4)):
        gram = gram_of(J, dtype)
        eager = agg.weights(gram).numpy()
        graph = tf.function(agg.weights)(gram).numpy()
        xla = tf.function(agg.weights, jit_compile=True)(gram).numpy()
        np.testing.assert_allclose(graph, eager, rtol=rtol, atol=rtol * 1e-2)
        np.testing.assert_allclose(xla, eager, rtol=rtol, atol=rtol * 1e-2)
    w16 = agg.weights(gram_of(J, tf.float16))
    assert w16.dtype == tf.float16
    np.testing.assert_allclose(w16.numpy(), eager, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("case", ["zero_task", "identical", "opposite", "single", "zero"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_degenerate_grams_give_finite_weights(name, case, dtype):
    J = scaled_jacobian(3, seed=12, conflict=0.5)
    if case == "zero_task":
        J[1] = 0.0
    elif case == "identical":
        J[2] = J[0]
    elif case == "opposite":
        J[1] = -J[0]
    elif case == "single":
        J = J[:1]
    else:
        J = np.zeros_like(J)
    agg = aggregators.get(name)
    fns = [agg.weights]
    if dtype == tf.float32:  # XLA once per case (each compile takes seconds)
        fns.append(tf.function(agg.weights, jit_compile=True))
    for fn in fns:
        w = fn(gram_of(J, dtype)).numpy()
        assert w.shape == (len(J),) and np.isfinite(w).all(), (case, w)
    if case == "single":
        assert w[0] > 0
    if case == "zero":
        assert np.isfinite(w @ J).all() and np.all(w @ J == 0)


@pytest.mark.parametrize("name", NEW)
def test_nonfinite_gram_gives_nonfinite_weights(name):
    gram = np.eye(3)
    gram[0, 1] = gram[1, 0] = np.nan
    w = aggregators.get(name).weights(tf.constant(gram, tf.float32)).numpy()
    assert not np.isfinite(w).all()


def test_options_are_validated():
    for cls in (aggregators.UPGrad, aggregators.DualProj):
        expected = r"`reg_eps` must be a number >= 0.0. Received: reg_eps=-1"
        with pytest.raises(ValueError, match=expected):
            cls(reg_eps=-1)
        with pytest.raises(ValueError, match=r"`max_iter` must be an integer >= 1"):
            cls(max_iter=0)
    with pytest.raises(ValueError, match=r"`norm_eps` must be a number"):
        aggregators.UPGrad(norm_eps="1")
    with pytest.raises(ValueError, match=r"`reg_eps` must be a number"):
        aggregators.NashMTL(reg_eps=True)
    clone = aggregators.get(aggregators.serialize(aggregators.UPGrad(reg_eps=0.0)))
    assert clone.get_config() == {"norm_eps": 1e-4, "reg_eps": 0.0}


def test_new_names_are_registered():
    for name in NEW:
        assert name in aggregators.NAMES
        assert aggregators.get(name.upper()).name == name
