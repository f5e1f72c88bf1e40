"""Tests of keras_fastgrad.aggregators against independent numpy references.

Every reference below is written from the paper (or the official code) on
explicit gradient vectors `J` (`T x P`), never by calling the TF code.
"""

import itertools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers import pcgrad_np  # noqa: E402
from scipy.optimize import minimize  # noqa: E402

from keras_fastgrad import aggregators  # noqa: E402

P = 50


def _jac(num_tasks, seed, conflict=0.0):
    """Random `J`; `conflict > 0` pulls tasks 1.. against task 0."""
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, P))
    J[1:] -= conflict * J[0]
    return J


def _gram(J, dtype=tf.float64):
    return tf.constant(J @ J.T, dtype)


def _merged(w, J):
    return np.asarray(w, np.float64) @ J


# ---------------------------------------------------------------- references


def min_norm_np(J):
    """Exact min-norm point of conv{g_t}: best affine minimiser of all faces."""
    G = J @ J.T
    best = None
    for size in range(1, len(J) + 1):
        for face in itertools.combinations(range(len(J)), size):
            x = np.linalg.lstsq(G[np.ix_(face, face)], np.ones(size), rcond=None)[0]
            if x.sum() <= 0:
                continue
            w = np.zeros(len(J))
            w[list(face)] = x / x.sum()
            if w.min() >= -1e-12 and (best is None or w @ G @ w < best @ G @ best):
                best = w
    return best


def cagrad_np(J, c=0.5, rescale=1):
    """The official `cagrad` function (Cranial-XIX/CAGrad), SLSQP included."""
    T = len(J)
    GG = J @ J.T
    g0_norm = np.sqrt(GG.mean() + 1e-8)
    x_start = np.ones(T) / T
    cc = c * g0_norm + 1e-8

    def objfn(x):
        return x @ GG @ x_start + cc * np.sqrt(x @ GG @ x + 1e-8)

    res = minimize(
        objfn,
        x_start,
        bounds=[(0, 1)] * T,
        method="SLSQP",
        constraints={"type": "eq", "fun": lambda x: 1 - x.sum()},
        options={"ftol": 1e-13, "maxiter": 1000},
    )
    gw = res.x @ J
    g = J.mean(0) + cc / (np.linalg.norm(gw) + 1e-8) * gw
    return g / {0: 1.0, 1: 1 + c**2, 2: 1 + c}[rescale], objfn, res.x


def imtl_np(J):
    """IMTL-G closed form (Liu et al., 2021) on explicit vectors."""
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    D = J[0] - J[1:]
    Ud = U[0] - U[1:]
    alpha = J[0] @ Ud.T @ np.linalg.inv(D @ Ud.T)
    alpha = np.concatenate([[1 - alpha.sum()], alpha])
    return alpha @ J, U


def aligned_np(J):
    """Official `ProcrustesSolver.apply` (scale_mode='min') + balancer sum."""
    G = J @ J.T
    lam, V = np.linalg.eigh(G)
    tol = lam.max() * len(J) * np.finfo(np.float32).eps
    rank = int((lam > tol).sum())
    order = np.argsort(lam)[::-1]
    lam, V = lam[order][:rank], V[:, order][:, :rank]
    B = (V * np.sqrt(lam[-1])) / np.sqrt(lam)
    B = B @ V.T
    aligned = J.T @ B  # P x T aligned task gradients
    return aligned.sum(-1), B, lam[-1]


# --------------------------------------------------------------------- PCGrad


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_pcgrad_matches_algorithm1(num_tasks):
    J = _jac(num_tasks, seed=num_tasks, conflict=0.6)
    assert (J @ J.T < 0).any()
    rng = np.random.default_rng(0)
    for _ in range(3):
        others = [[j for j in range(num_tasks) if j != i] for i in range(num_tasks)]
        orders = np.array([rng.permutation(o) for o in others], np.int32)
        orders = orders.reshape(num_tasks, num_tasks - 1)
        w = aggregators.PCGrad().weights(_gram(J), orders=orders)
        expected = pcgrad_np(J, orders)
        np.testing.assert_allclose(_merged(w, J), expected, rtol=1e-5, atol=1e-8)


def test_pcgrad_random_order_under_xla():
    J = _jac(3, seed=7, conflict=0.7)
    others = [[j for j in range(3) if j != i] for i in range(3)]
    candidates = [
        pcgrad_np(J, [list(p) for p in perms])
        for perms in itertools.product(*[itertools.permutations(o) for o in others])
    ]
    assert len({tuple(np.round(c, 6)) for c in candidates}) > 1  # the order matters
    agg = aggregators.PCGrad(seed=1)
    fn = tf.function(agg.weights, jit_compile=True)
    gram = _gram(J, tf.float32)
    results = []
    for _ in range(20):
        merged = _merged(fn(gram).numpy(), J)
        dists = [np.max(np.abs(merged - c)) / np.max(np.abs(c)) for c in candidates]
        assert min(dists) < 1e-4
        results.append(int(np.argmin(dists)))
    assert len(set(results)) >= 2


def test_pcgrad_seed_makes_its_orders_reproducible():
    # The same seed, the same sequence of visiting orders (under XLA too);
    # each call draws fresh ones.
    gram = _gram(_jac(4, seed=3, conflict=0.7), tf.float32)
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
    pc = _merged(aggregators.get("pcgrad").weights(_gram(J)), J)
    assert pc @ J[0] > 0 and pc @ J[1] > 0


def test_pcgrad_zero_gradient_is_finite():
    J = _jac(3, seed=1, conflict=0.8)
    J[1] = 0.0
    orders = [[1, 2], [0, 2], [0, 1]]
    w = aggregators.PCGrad().weights(_gram(J, tf.float32), orders=orders)
    assert np.all(np.isfinite(w.numpy()))
    expected = pcgrad_np(J, [[2], [0, 2], [0]])  # projecting on 0 is a no-op
    np.testing.assert_allclose(_merged(w, J), expected, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------- MGDA


@pytest.mark.parametrize(
    "num_tasks,case",
    [(2, "plain"), (3, "plain"), (4, "plain"), (4, "face"), (4, "ill")],
)
def test_mgda_min_norm(num_tasks, case):
    J = _jac(num_tasks, seed=10 + num_tasks)
    if case == "face":  # the min-norm point has w_2 = 0
        J[2] = 4.0 * (J[0] + J[1]) + 0.1 * J[2]
    if case == "ill":  # a large gradient and a near-opposite one (cond ~ 1e3)
        J[0] *= 5.0
        J[1] = -0.8 * J[0] + 0.3 * J[1]
    ref = min_norm_np(J)
    assert case != "face" or ref[2] == 0
    w = aggregators.MGDA().weights(_gram(J)).numpy()
    assert w.min() >= -1e-12 and abs(w.sum() - 1) < 1e-9
    norm = np.linalg.norm(w @ J)
    np.testing.assert_allclose(norm, np.linalg.norm(ref @ J), rtol=1e-4)
    rng = np.random.default_rng(0)
    others = np.concatenate([np.eye(num_tasks), rng.dirichlet(np.ones(num_tasks), 200)])
    assert norm <= np.linalg.norm(others @ J, axis=1).min() * (1 + 1e-9)


# --------------------------------------------------------------------- CAGrad


@pytest.mark.parametrize(
    "num_tasks,c,rescale", [(2, 0.5, 1), (3, 0.5, 1), (4, 0.4, 0), (4, 0.8, 2)]
)
def test_cagrad_matches_official(num_tasks, c, rescale):
    J = _jac(num_tasks, seed=20 + num_tasks, conflict=0.5)
    w = aggregators.CAGrad(c=c, rescale=rescale).weights(_gram(J)).numpy()
    expected, objfn, x_ref = cagrad_np(J, c, rescale)
    np.testing.assert_allclose(_merged(w, J), expected, rtol=1e-3, atol=1e-4)
    # The in-graph simplex solution is at least as good as SLSQP's.
    lam_w = w * {0: 1.0, 1: 1 + c**2, 2: 1 + c}[rescale] - 1.0 / num_tasks
    x_ours = lam_w / lam_w.sum()
    assert objfn(x_ours) <= objfn(x_ref) + 1e-9 * abs(objfn(x_ref))


def test_cagrad_c0_is_mean():
    J = _jac(3, seed=5, conflict=0.5)
    w = aggregators.CAGrad(c=0.0).weights(_gram(J)).numpy()
    np.testing.assert_allclose(w, np.full(3, 1 / 3), atol=1e-7)


# ----------------------------------------------------------------------- IMTL


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_imtl_matches_paper(num_tasks):
    J = _jac(num_tasks, seed=30 + num_tasks, conflict=0.4)
    J *= np.arange(1, num_tasks + 1)[:, None]  # unequal norms
    merged = _merged(aggregators.IMTL().weights(_gram(J)), J)
    expected, U = imtl_np(J)
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-8)
    projections = U @ merged  # <g, u_t> equal for every task
    np.testing.assert_allclose(projections, projections[0], rtol=1e-6)


def test_imtl_singular_is_finite():
    J = _jac(3, seed=2)
    J[2] = J[1]
    w = aggregators.IMTL().weights(_gram(J, tf.float32)).numpy()
    assert np.all(np.isfinite(w))
    merged = _merged(w, J)
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    np.testing.assert_allclose(U @ merged, (U @ merged)[0], rtol=1e-3)


def imtl_pinv_np(G):
    """IMTL-G from a Gram matrix as torchjd generalises it, numpy float64:
    `w = pinv(G) d / sum(pinv(G) d)`, `d` the task gradient norms, numpy's
    default (array API) cut-off `T eps`; zeros when the sum vanishes."""
    G = np.asarray(G, np.float64)
    v = np.linalg.pinv(G, rtol=None) @ np.sqrt(np.diag(G))
    return np.zeros_like(v) if abs(v.sum()) < 1e-12 else v / v.sum()


@pytest.mark.parametrize("num_tasks, rank", [(2, 2), (3, 3), (4, 4), (5, 5), (4, 2)])
def test_imtl_matches_numpy_pinv_formula_on_random_grams(num_tasks, rank):
    rng = np.random.default_rng(70 + num_tasks + rank)
    J = rng.normal(size=(rank, P))
    J = rng.normal(size=(num_tasks, rank)) @ J  # rank-deficient when rank < T
    J *= rng.uniform(0.1, 10.0, size=(num_tasks, 1))
    w = aggregators.IMTL().weights(_gram(J)).numpy()
    np.testing.assert_allclose(w, imtl_pinv_np(J @ J.T), rtol=1e-6, atol=1e-9)
    if rank == num_tasks:  # else no direction has equal projections
        U = J / np.linalg.norm(J, axis=1, keepdims=True)
        np.testing.assert_allclose(U @ (w @ J), (U @ (w @ J))[0], rtol=1e-6)


@pytest.mark.parametrize("zero_task", [0, 1, 2])
def test_imtl_zero_gradient_task_does_not_zero_the_update(zero_task):
    J = _jac(3, seed=80, conflict=0.4)
    J[zero_task] = 0.0
    w = aggregators.IMTL().weights(_gram(J)).numpy()
    others = [t for t in range(3) if t != zero_task]
    # By hand: the zero task gets nothing; the two others get the paper's
    # closed form on their own (equal projections, weights summing to 1).
    expected_merged, U = imtl_np(J[others])
    assert w[zero_task] == 0.0
    np.testing.assert_allclose(w @ J, expected_merged, rtol=1e-6, atol=1e-9)
    assert np.linalg.norm(w @ J) > 0.1
    np.testing.assert_allclose(w, imtl_pinv_np(J @ J.T), rtol=1e-6, atol=1e-12)


def test_imtl_keeps_small_real_singular_values_of_a_float64_gram():
    # Tasks 0 and 1 differ by 1e-3: the Gram's smallest eigenvalue is ~2e-7
    # of the largest, real in float64 (eps 2e-16) but below a float32-sized
    # cut-off (T * 10 * 1.2e-7), which would answer ~5% off.
    rng = np.random.default_rng(91)
    J = rng.normal(size=(3, P))
    J[1] = J[0] + 1e-3 * rng.normal(size=P)
    G = J @ J.T
    eigenvalues = np.linalg.eigvalsh(G)
    assert 1e-8 < eigenvalues[0] / eigenvalues[-1] < 1e-6
    w = aggregators.IMTL().weights(tf.constant(G, tf.float64)).numpy()
    np.testing.assert_allclose(w, imtl_pinv_np(G), rtol=1e-7)
    expected_merged, U = imtl_np(J)  # the paper's closed form, plain inverse
    np.testing.assert_allclose(w @ J, expected_merged, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(U @ (w @ J), (U @ (w @ J))[0], rtol=1e-7)


# ---------------------------------------------------------------- Aligned-MTL


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_aligned_matches_official(num_tasks):
    J = _jac(num_tasks, seed=40 + num_tasks, conflict=0.5)
    J *= np.arange(1, num_tasks + 1)[:, None]
    agg = aggregators.AlignedMTL()
    merged = _merged(agg.weights(_gram(J)), J)
    expected, B_ref, lam_min = aligned_np(J)
    np.testing.assert_allclose(merged, expected, rtol=1e-6, atol=1e-9)
    # Balanced: the aligned gradients J^T B are orthogonal with equal norms
    # sqrt(lam_min), so the merged direction has equal components on each.
    B = agg.balance_matrix(_gram(J)).numpy()
    np.testing.assert_allclose(B, B_ref, rtol=1e-6, atol=1e-9)
    aligned = J.T @ B
    eye = np.eye(num_tasks)
    np.testing.assert_allclose(aligned.T @ aligned, lam_min * eye, atol=1e-6 * lam_min)
    np.testing.assert_allclose(aligned.T @ merged, lam_min * eye.sum(0), rtol=1e-6)


def test_aligned_rank_deficient_matches_official():
    J = _jac(3, seed=4)
    J[2] = J[0] + J[1]
    merged = _merged(aggregators.AlignedMTL().weights(_gram(J)), J)
    np.testing.assert_allclose(merged, aligned_np(J)[0], rtol=1e-5, atol=1e-8)


def _nan_gram():
    J = _jac(3, seed=5, conflict=0.5)
    J[1, 7] = np.nan  # one NaN in one task's gradient
    return tf.constant(J @ J.T, tf.float32)


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


def test_aligned_fit_drops_a_nan_sample_and_keeps_weights_finite():
    keras.utils.set_random_seed(3)
    import keras_fastgrad

    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    outputs = [keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(hidden)]
    model = keras_fastgrad.FastGradModel(inputs, outputs, multitask="aligned")
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = [rng.normal(size=(16, 1)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")]
    x[5, 1] = np.nan  # batch 1 of 4
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.telemetry_counters()["nonfinite_count"] >= 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(
        model.evaluate(np.delete(x, 5, 0), [t[np.arange(16) != 5] for t in y], verbose=0)
    ).all()
    assert len(history.history["loss"]) == 1


# ------------------------------------------------------------------------ all


def _call(agg, gram):
    if isinstance(agg, aggregators.PCGrad):  # fixed visiting orders
        t = gram.shape[0]
        orders = [[j for j in range(t) if j != i] for i in range(t)]
        return agg.weights(gram, orders=tf.constant(orders, tf.int32, shape=(t, t - 1)))
    return agg.weights(gram)


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_xla_and_graph_match_eager_and_keep_dtype(name):
    J = _jac(3, seed=50, conflict=0.5)
    agg = aggregators.get(name)
    gram32 = _gram(J, tf.float32)
    eager = _call(agg, gram32)
    xla = tf.function(lambda g: _call(agg, g), jit_compile=True)(gram32)
    graph = tf.function(lambda g: _call(agg, g))(gram32)
    assert eager.dtype == tf.float32 and xla.dtype == tf.float32
    assert eager.shape == (3,)
    np.testing.assert_allclose(xla.numpy(), eager.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(graph.numpy(), eager.numpy(), rtol=1e-4, atol=1e-5)
    assert _call(agg, tf.cast(gram32, tf.float16)).dtype == tf.float16
    w64 = _call(agg, _gram(J))
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
    J = _jac(4, seed=60, conflict=0.5)
    J[3] = 0.0
    t = aggregators.gram_telemetry(_gram(J))
    norms = np.linalg.norm(J, axis=1)
    np.testing.assert_allclose(t["norms"].numpy(), norms, rtol=1e-10)
    safe = np.where(norms > 0, norms, 1.0)
    cosine = np.where(np.outer(norms, norms) > 0, (J @ J.T) / np.outer(safe, safe), 0.0)
    np.testing.assert_allclose(t["cosine"].numpy(), cosine, rtol=1e-10, atol=1e-12)
    G = J @ J.T
    pairs = itertools.combinations(range(4), 2)
    assert int(t["num_conflicts"]) == sum(G[i, j] < 0 for i, j in pairs)
