"""The registry (`aggregators/__init__.py`: `get`, `serialize`, `NAMES`,
`gram_telemetry`) and what every aggregator shares: dtypes, XLA, degenerate
and non-finite Grams, option checks."""

import itertools

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    NEW,
    compiled,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    jit_matches_eager_under_jax,
    random_jacobian,
    scaled_jacobian,
)

# The modes a test compares with eager calls: TensorFlow's graph and XLA;
# JAX has one (`jax.jit`, XLA).
MODES = ("function", "xla") if keras.backend.backend() == "tensorflow" else ("xla",)


def _nan_gram():
    J = random_jacobian(3, seed=5, conflict=0.5)
    J[1, 7] = np.nan  # one NaN in one task's gradient
    return (J @ J.T).astype(np.float32)


def _call(agg, gram):
    if isinstance(agg, aggregators.PCGrad):  # fixed visiting orders
        t = gram.shape[0]
        orders = np.array([[j for j in range(t) if j != i] for i in range(t)], np.int32)
        return agg.weights(gram, orders=orders.reshape(t, t - 1))
    return agg.weights(gram)


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@pytest.mark.parametrize("name", ["aligned", "imtl"])
@pytest.mark.parametrize("mode", ("eager",) + MODES)
def test_nonfinite_gram_gives_nonfinite_weights_without_error(name, mode):
    agg = aggregators.get(name)
    fn = agg.weights if mode == "eager" else compiled(agg.weights, jit_compile=mode == "xla")
    gram = _nan_gram()
    assert not np.all(np.isfinite(gram))
    w = np.asarray(fn(gram))  # `eigh` on a NaN Gram would raise on CPU
    assert w.shape == (3,) and not np.any(np.isfinite(w))
    inf_gram = np.array([[np.inf, 0.0], [0.0, 1.0]])
    assert not np.any(np.isfinite(np.asarray(fn(inf_gram))))


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_xla_and_graph_match_eager_and_keep_dtype(name):
    J = random_jacobian(3, seed=50, conflict=0.5)
    agg = aggregators.get(name)
    gram32 = gram_of(J, "float32")
    eager = _call(agg, gram32)
    assert _dtype(eager) == "float32" and eager.shape == (3,)
    for mode in MODES:
        traced = compiled(lambda g: _call(agg, g), jit_compile=mode == "xla")(gram32)
        assert _dtype(traced) == "float32"
        np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=1e-4, atol=1e-5)
    assert _dtype(_call(agg, gram_of(J, "float16"))) == "float16"
    w64 = _call(agg, gram_of(J))
    assert _dtype(w64) == "float64"
    np.testing.assert_allclose(np.asarray(w64), np.asarray(eager), rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's 32-bit default")
@pytest.mark.parametrize("name", ["mean", "sum", "upgrad", "dualproj", "mgda", "cagrad"])
def test_jax_jit_matches_eager_with_32_bit_types(name):
    # As in a JAX training step: float32, 64-bit types off (the other tests
    # here turn them on for their float64 cases).
    jit_matches_eager_under_jax(aggregators.get(name))


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_single_task_and_zero_gram_are_finite(name):
    agg = aggregators.get(name)
    assert np.all(np.isfinite(np.asarray(_call(agg, np.array([[4.0]], np.float32)))))
    assert np.all(np.isfinite(np.asarray(_call(agg, np.zeros([3, 3], np.float32)))))


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
        aggregators.Mean().weights(np.zeros([2, 3]))


def test_gram_telemetry():
    J = random_jacobian(4, seed=60, conflict=0.5)
    J[3] = 0.0
    t = aggregators.gram_telemetry(gram_of(J))
    norms = np.linalg.norm(J, axis=1)
    np.testing.assert_allclose(np.asarray(t["norms"]), norms, rtol=1e-10)
    safe = np.where(norms > 0, norms, 1.0)
    cosine = np.where(np.outer(norms, norms) > 0, (J @ J.T) / np.outer(safe, safe), 0.0)
    np.testing.assert_allclose(np.asarray(t["cosine"]), cosine, rtol=1e-10, atol=1e-12)
    G = J @ J.T
    pairs = itertools.combinations(range(4), 2)
    assert int(t["num_conflicts"]) == sum(G[i, j] < 0 for i, j in pairs)


@pytest.mark.parametrize("name", NEW)
def test_graph_and_xla_match_eager_on_conflicting_tasks(name):
    J = scaled_jacobian(4, seed=11, conflict=0.7)
    agg = aggregators.get(name)
    for dtype, rtol in (("float64", 1e-9), ("float32", 1e-4)):
        gram = gram_of(J, dtype)
        eager = np.asarray(agg.weights(gram))
        for mode in MODES:
            traced = np.asarray(compiled(agg.weights, jit_compile=mode == "xla")(gram))
            np.testing.assert_allclose(traced, eager, rtol=rtol, atol=rtol * 1e-2)
    w16 = agg.weights(gram_of(J, "float16"))
    assert _dtype(w16) == "float16"
    np.testing.assert_allclose(np.asarray(w16), eager, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("case", ["zero_task", "identical", "opposite", "single", "zero"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
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
    if dtype == "float32":  # XLA once per case (each compile takes seconds)
        fns.append(compiled(agg.weights))
    for fn in fns:
        w = np.asarray(fn(gram_of(J, dtype)))
        assert w.shape == (len(J),) and np.isfinite(w).all(), (case, w)
    if case == "single":
        assert w[0] > 0
    if case == "zero":
        assert np.isfinite(w @ J).all() and np.all(w @ J == 0)


@pytest.mark.parametrize("name", NEW)
def test_nonfinite_gram_gives_nonfinite_weights(name):
    gram = np.eye(3)
    gram[0, 1] = gram[1, 0] = np.nan
    w = np.asarray(aggregators.get(name).weights(gram.astype(np.float32)))
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
