"""UPGrad, DualProj, ConFIG, GradVac and Nash-MTL against numpy references.

Each reference is written from the paper's equations (or the official
code) on explicit gradient vectors `J` (`T x P`) or, for the quadratic
programs, by brute force over active sets with a KKT check; none calls the
TensorFlow code. The end-to-end tests train a two-head model and compare
its step with the same references.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import least_squares, minimize
from test_multitask import (
    assert_step,
    build,
    compiled,
    expected_gradient,
    flat,
    make_data,
    reference_model,
    shared_mask,
    task_gradients,
    weights_of,
)

from keras_fastgrad import aggregators
from keras_fastgrad.multitask.merger import TaskMerger

NEW = ("upgrad", "dualproj", "config", "gradvac", "nashmtl")
P = 12


def _jac(num_tasks, seed, conflict=0.0, size=P):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, size))
    J[1:] -= conflict * J[0]
    return J * rng.uniform(0.5, 3.0, size=(num_tasks, 1))


def _gram(J, dtype=tf.float64):
    return tf.constant(J @ J.T, dtype)


# ---------------------------------------------------------------- references
def dual_cone_qp_np(G, u):
    """`argmin v^T G v s.t. v >= u` by brute force over the active sets:
    the KKT point (v >= u, (Gv)_free = 0, (Gv)_active >= 0) of least cost."""
    T, best = len(u), None
    tol = 1e-9 * max(1.0, np.abs(G).max())
    for size in range(T + 1):
        for active in itertools.combinations(range(T), size):
            free = [i for i in range(T) if i not in active]
            v = np.array(u, np.float64)
            if free:
                rhs = -G[np.ix_(free, list(active))] @ v[list(active)]
                v[free] = np.linalg.lstsq(G[np.ix_(free, free)], rhs, rcond=None)[0]
            grad = G @ v
            if (
                (v >= u - tol).all()
                and (grad[list(active)] >= -tol).all()
                and (np.abs(grad[free]) <= tol * max(1.0, np.abs(v).max())).all()
            ):
                if best is None or v @ G @ v < best @ G @ best - tol:
                    best = v
    return best


def torchjd_gram_np(G, norm_eps=1e-4, reg_eps=1e-4):
    trace = np.trace(G)
    G = np.zeros_like(G) if trace < norm_eps else G / trace
    return G + reg_eps * np.eye(len(G))


def upgrad_np(G, **eps):
    """torchjd's UPGradWeighting: sum_i v(e_i / T)."""
    Gn, T = torchjd_gram_np(G, **eps), len(G)
    return sum(dual_cone_qp_np(Gn, np.eye(T)[i] / T) for i in range(T))


def dualproj_np(G, **eps):
    T = len(G)
    return dual_cone_qp_np(torchjd_gram_np(G, **eps), np.full(T, 1.0 / T))


def project_dual_cone_vector_np(J, g):
    """The definition: argmin ||x - g||^2 s.t. J x >= 0 (SLSQP, vectors)."""
    res = minimize(
        lambda x: np.sum((x - g) ** 2),
        g,
        jac=lambda x: 2 * (x - g),
        method="SLSQP",
        constraints={"type": "ineq", "fun": lambda x: J @ x, "jac": lambda x: J},
        options={"ftol": 1e-15, "maxiter": 500},
    )
    return res.x


def config_np(J):
    """Official `ConFIG_update` (conflictfree): pinv of the unit gradients
    times ones, made unit, scaled by the sum of projections."""
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    best = np.linalg.pinv(U) @ np.ones(len(J))
    unit = best / np.linalg.norm(best)
    return np.sum(J @ unit) * unit


def gradvac_np(J, targets, beta):
    """GradVac Algorithm 1 on vectors, other tasks in increasing order."""
    targets = np.array(targets, np.float64)
    total = np.zeros(J.shape[1])
    for i in range(len(J)):
        g = J[i].copy()
        for j in [k for k in range(len(J)) if k != i]:
            phi = g @ J[j] / (np.linalg.norm(g) * np.linalg.norm(J[j]))
            t = targets[i, j]
            if phi < t:
                g = g + J[j] * np.linalg.norm(g) * (
                    t * np.sqrt(1 - phi**2) - phi * np.sqrt(1 - t**2)
                ) / (np.linalg.norm(J[j]) * np.sqrt(1 - t**2))
            targets[i, j] = (1 - beta) * t + beta * phi
        total += g
    return total, targets


def nash_np(G):
    """Solves G_n a = 1/a (G_n = G / ||G||_F), a > 0, with scipy."""
    Gn = G / np.linalg.norm(G)
    res = least_squares(
        lambda a: Gn @ a - 1 / a,
        np.ones(len(G)),
        bounds=(1e-12, np.inf),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
    )
    return res.x


# ------------------------------------------------------------ UPGrad/DualProj
@pytest.mark.parametrize("num_tasks", [2, 3, 4])
@pytest.mark.parametrize("conflict", [0.3, 0.8])
def test_upgrad_and_dualproj_match_active_set_qp(num_tasks, conflict):
    J = _jac(num_tasks, seed=num_tasks + int(10 * conflict), conflict=conflict)
    G = J @ J.T
    assert (G < 0).any()
    w = aggregators.get("upgrad").weights(_gram(J)).numpy()
    np.testing.assert_allclose(w, upgrad_np(G), rtol=1e-7, atol=1e-10)
    w = aggregators.get("dualproj").weights(_gram(J)).numpy()
    np.testing.assert_allclose(w, dualproj_np(G), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_upgrad_and_dualproj_are_the_dual_cone_projections(num_tasks):
    J = _jac(num_tasks, seed=40 + num_tasks, conflict=0.7)
    options = {"norm_eps": 0.0, "reg_eps": 0.0}
    projections = [project_dual_cone_vector_np(J, g) for g in J]
    upgrad = aggregators.UPGrad(**options).weights(_gram(J)).numpy() @ J
    np.testing.assert_allclose(upgrad, np.mean(projections, 0), rtol=1e-5, atol=1e-7)
    dualproj = aggregators.DualProj(**options).weights(_gram(J)).numpy() @ J
    expected = project_dual_cone_vector_np(J, J.mean(0))
    np.testing.assert_allclose(dualproj, expected, rtol=1e-5, atol=1e-7)
    for merged in (upgrad, dualproj):  # no task is made worse
        assert (J @ merged >= -1e-10 * np.abs(J @ J.T).max()).all()
    assert (J @ J.mean(0) < 0).any()  # while the mean makes one worse


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_no_conflict_is_the_mean(name):
    J = np.abs(_jac(3, seed=3))  # positive entries: every G_ij > 0
    agg = aggregators.get(name)
    np.testing.assert_allclose(
        type(agg)(reg_eps=0.0).weights(_gram(J)).numpy(), np.full(3, 1 / 3), rtol=1e-12
    )


def test_dual_cone_solver_hard_case_float32():
    # Nearly opposite, very unequal gradients: an ill-conditioned QP.
    J = _jac(4, seed=9, conflict=0.95)
    J[3] = -0.99 * J[2] + 0.01 * J[3]
    G = J @ J.T
    for name, ref in (("upgrad", upgrad_np), ("dualproj", dualproj_np)):
        w = aggregators.get(name).weights(tf.constant(G, tf.float32)).numpy()
        np.testing.assert_allclose(w, ref(G), rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------- ConFIG
@pytest.mark.parametrize("num_tasks", [2, 3, 4])
def test_config_matches_official_and_has_equal_cosines(num_tasks):
    J = _jac(num_tasks, seed=50 + num_tasks, conflict=0.6)
    merged = aggregators.ConFIG().weights(_gram(J)).numpy() @ J
    np.testing.assert_allclose(merged, config_np(J), rtol=1e-8, atol=1e-10)
    cosines = J @ merged / (np.linalg.norm(J, axis=1) * np.linalg.norm(merged))
    np.testing.assert_allclose(cosines, cosines[0], rtol=1e-8)
    assert cosines[0] > 0
    unit = merged / np.linalg.norm(merged)  # the magnitude rule
    np.testing.assert_allclose(np.linalg.norm(merged), np.sum(J @ unit), rtol=1e-10)


def test_config_zero_gradient_task_is_ignored():
    J = _jac(3, seed=5, conflict=0.5)
    J[1] = 0.0
    w = aggregators.ConFIG().weights(_gram(J)).numpy()
    assert np.isfinite(w).all() and w[1] == 0.0
    np.testing.assert_allclose(w @ J, config_np(J[[0, 2]]), rtol=1e-8)


# --------------------------------------------------------------------- GradVac
def test_gradvac_first_step_is_pcgrad():
    J = _jac(3, seed=6, conflict=0.7)
    w = aggregators.GradVac().weights(_gram(J)).numpy()
    np.testing.assert_allclose(w @ J, gradvac_np(J, np.zeros((3, 3)), 0.01)[0], rtol=1e-9)
    pc = aggregators.PCGrad().weights(_gram(J), orders=[[1, 2], [0, 2], [0, 1]])
    np.testing.assert_allclose(w, pc.numpy(), rtol=1e-9)


@pytest.mark.parametrize("num_tasks,beta", [(2, 0.5), (3, 0.3), (4, 0.01)])
def test_gradvac_follows_the_ema_over_steps(num_tasks, beta):
    merger = TaskMerger(aggregators.GradVac(beta=beta))
    targets = np.zeros((num_tasks, num_tasks))
    altered = 0
    for step in range(6):
        J = _jac(num_tasks, seed=100 + step, conflict=0.3 * (step % 3))
        per_task = [[tf.constant(g, tf.float32)] for g in J]
        merged, info = merger.merge(per_task)
        expected, targets = gradvac_np(J, targets, beta)
        np.testing.assert_allclose(merged[0].numpy(), expected, rtol=2e-4, atol=2e-5)
        state = merger.aggregator.state_variables[0].numpy()
        np.testing.assert_allclose(state, targets, rtol=1e-4, atol=1e-6)
        altered += not np.allclose(expected, J.sum(0))
    assert altered >= 3 and np.abs(targets).max() > 0.01


def test_gradvac_state_ignores_a_nonfinite_step():
    merger = TaskMerger("gradvac")
    J = _jac(2, seed=1, conflict=0.8)
    head = tf.ones([3])
    merger.merge([[tf.constant(J[0], tf.float32), None], [tf.constant(J[1], tf.float32), head]])
    before = merger.aggregator.state_variables[0].numpy()
    assert np.abs(before).max() > 0
    J = _jac(2, seed=2, conflict=0.9)  # finite shared gradients, a NaN head
    nan_head = tf.constant([1.0, np.nan, 1.0])
    per_task = [[tf.constant(J[0], tf.float32), None], [tf.constant(J[1], tf.float32), nan_head]]
    merged, info = merger.merge(per_task)
    assert np.isfinite(info["gram"].numpy()).all() and np.isfinite(merged[0].numpy()).all()
    np.testing.assert_array_equal(merger.aggregator.state_variables[0].numpy(), before)
    J[1, 3] = np.nan  # a NaN shared gradient
    merged, _ = merger.merge([[tf.constant(g, tf.float32), None] for g in J])
    assert not np.isfinite(merged[0].numpy()).all()
    np.testing.assert_array_equal(merger.aggregator.state_variables[0].numpy(), before)
    merger.merge([[tf.constant(g, tf.float32), None] for g in _jac(2, seed=3, conflict=0.9)])
    assert not np.array_equal(merger.aggregator.state_variables[0].numpy(), before)


def test_gradvac_options_and_state_api():
    expected = r"`beta` must be a number >= 0.0 and <= 1.0. Received: beta=2"
    with pytest.raises(ValueError, match=expected):
        aggregators.GradVac(beta=2)
    agg = aggregators.get(aggregators.serialize(aggregators.GradVac(beta=0.2)))
    assert agg.beta == 0.2 and agg.state_variables == []
    agg.build(3)
    assert agg.state_variables[0].shape == (3, 3)
    w, (new,) = agg.weights_and_state(tf.eye(3, dtype=tf.float16) - 0.3)
    assert w.dtype == tf.float16 and new.dtype == tf.float32


# -------------------------------------------------------------------- Nash-MTL
@pytest.mark.parametrize("num_tasks", [2, 3, 4, 6])
def test_nashmtl_solves_the_bargaining_condition(num_tasks):
    J = _jac(num_tasks, seed=70 + num_tasks, conflict=0.3, size=20)
    G = J @ J.T
    w = aggregators.NashMTL(reg_eps=0.0).weights(_gram(J)).numpy()
    Gn = G / np.linalg.norm(G)
    assert (w > 0).all()
    np.testing.assert_allclose(Gn @ w, 1 / w, rtol=1e-9)
    np.testing.assert_allclose(w, nash_np(G), rtol=1e-6)
    w32 = aggregators.get("nashmtl").weights(_gram(J, tf.float32)).numpy()
    np.testing.assert_allclose(w32, w, rtol=1e-3)


def test_nashmtl_zero_gradient_task_gets_zero_weight():
    J = _jac(3, seed=8, conflict=0.3)
    J[2] = 0.0
    w = aggregators.NashMTL(reg_eps=0.0).weights(_gram(J)).numpy()
    assert w[2] == 0.0 and np.isfinite(w).all()
    G = J @ J.T
    Gn = G / np.linalg.norm(G)  # the others bargain among themselves
    np.testing.assert_allclose((Gn @ w)[:2], 1 / w[:2], rtol=1e-9)


# ---------------------------------------------------------------------- common
@pytest.mark.parametrize("name", NEW)
def test_graph_and_xla_match_eager_on_conflicting_tasks(name):
    J = _jac(4, seed=11, conflict=0.7)
    agg = aggregators.get(name)
    for dtype, rtol in ((tf.float64, 1e-9), (tf.float32, 1e-4)):
        gram = _gram(J, dtype)
        eager = agg.weights(gram).numpy()
        graph = tf.function(agg.weights)(gram).numpy()
        xla = tf.function(agg.weights, jit_compile=True)(gram).numpy()
        np.testing.assert_allclose(graph, eager, rtol=rtol, atol=rtol * 1e-2)
        np.testing.assert_allclose(xla, eager, rtol=rtol, atol=rtol * 1e-2)
    w16 = agg.weights(_gram(J, tf.float16))
    assert w16.dtype == tf.float16
    np.testing.assert_allclose(w16.numpy(), eager, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("case", ["zero_task", "identical", "opposite", "single", "zero"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_degenerate_grams_give_finite_weights(name, case, dtype):
    J = _jac(3, seed=12, conflict=0.5)
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
        w = fn(_gram(J, dtype)).numpy()
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


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_max_iter_is_deprecated_and_old_configs_load(name):
    cls = type(aggregators.get(name))
    with pytest.warns(DeprecationWarning, match=r"`max_iter` is deprecated and ignored"):
        agg = cls(max_iter=7)
    assert agg.get_config() == {"norm_eps": 1e-4, "reg_eps": 1e-4}
    # A config saved before the exact solver (with `max_iter`) still loads.
    old = {
        "module": "keras_fastgrad",
        "class_name": cls.__name__,
        "config": {"norm_eps": 1e-4, "reg_eps": 0.0, "max_iter": 200},
        "registered_name": f"keras_fastgrad>{cls.__name__}",
    }
    for loaded in (aggregators.get(old), keras.saving.deserialize_keras_object(old)):
        assert type(loaded) is cls and loaded.get_config() == {"norm_eps": 1e-4, "reg_eps": 0.0}


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_keras_files_saved_with_max_iter_load_and_train(name):
    import os

    path = os.path.join(os.path.dirname(__file__), "data", f"{name}_max_iter_v0.1.0.keras")
    model = keras.models.load_model(path)  # saved by v0.1.0: config has `max_iter`
    assert type(model.multitask) is type(aggregators.get(name))
    assert "max_iter" not in model.multitask.get_config()
    x, y = make_data()
    model.train_on_batch(x, y)
    assert all(np.isfinite(w).all() for w in model.get_weights())


# --------------------------------------------------------------- in the model
def _weights_np(name, J):
    G = J @ J.T
    if name == "upgrad":
        return upgrad_np(G)
    if name == "dualproj":
        return dualproj_np(G)
    if name == "nashmtl":
        return nash_np(G)
    return None


@pytest.mark.parametrize("name", NEW)
def test_model_step_matches_the_reference(name):
    model = compiled(build(multitask=name))
    x, y = make_data()
    grads = task_gradients(reference_model(model), x, y)
    J = np.stack([flat(grads[t], shared_mask(model)) for t in "ab"])
    assert J[0] @ J[1] < 0
    if name == "config":
        merged = config_np(J)
    elif name == "gradvac":
        merged = gradvac_np(J, np.zeros((2, 2)), 0.01)[0]
    else:
        merged = _weights_np(name, J) @ J
    before = weights_of(model)
    model.train_on_batch(x, y)
    assert_step(before, weights_of(model), expected_gradient(model, grads, merged), rtol=1e-4)


@pytest.mark.parametrize("name", NEW)
def test_model_trains_and_round_trips(name, tmp_path):
    model = compiled(build(multitask=name))
    x, y = make_data(n=32)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.multitask) is type(model.multitask)
    assert loaded.multitask.get_config() == model.multitask.get_config()
    if name == "gradvac":  # the EMA targets come back
        saved = model.multitask.state_variables[0].numpy()
        assert np.abs(saved).max() > 0
        loaded.multitask.build(2)
        np.testing.assert_array_equal(loaded.multitask.state_variables[0].numpy(), saved)
    model.train_on_batch(x[:8], {t: v[:8] for t, v in y.items()})
    loaded.train_on_batch(x[:8], {t: v[:8] for t, v in y.items()})
    for a, b in zip(weights_of(model), weights_of(loaded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.multitask.state_variables, loaded.multitask.state_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_gradvac_state_restored_by_weights_file_and_plain_model_loads_it(tmp_path):
    model = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    x, y = make_data()
    model.train_on_batch(x, y)
    saved = model.multitask.state_variables[0].numpy()
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    fresh = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    fresh.load_weights(path)
    fresh.train_on_batch(x, y)  # builds the targets from the file, then moves them
    again = compiled(build(multitask=aggregators.GradVac(beta=0.5)))
    again.train_on_batch(x, y)  # from zeros: differs
    model.train_on_batch(x, y)
    np.testing.assert_allclose(
        fresh.multitask.state_variables[0].numpy(),
        model.multitask.state_variables[0].numpy(),
        rtol=1e-6,
        atol=1e-7,
    )
    assert not np.allclose(
        again.multitask.state_variables[0].numpy(), model.multitask.state_variables[0].numpy()
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
    before = model.multitask.state_variables[0].numpy()
    x[0, 0] = np.nan
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["nonfinite_count"] == 1.0
    np.testing.assert_array_equal(model.multitask.state_variables[0].numpy(), before)
    assert np.isfinite(before).all() and np.abs(before).max() > 0


def test_new_names_are_registered():
    for name in NEW:
        assert name in aggregators.NAMES
        assert aggregators.get(name.upper()).name == name


def test_config_keeps_small_real_directions_of_a_float64_gram():
    # Two tasks 1e-3 apart: the unit Gram's smallest eigenvalue is ~1e-7 of
    # the largest, a real direction in float64 that the official pinv keeps.
    rng = np.random.default_rng(13)
    J = rng.normal(size=(3, P))
    J[1] = J[0] + 1e-3 * rng.normal(size=P)
    merged = aggregators.ConFIG().weights(_gram(J)).numpy() @ J
    np.testing.assert_allclose(merged, config_np(J), rtol=1e-5, atol=1e-8)
