"""UPGrad and DualProj (`aggregators/_upgrad.py`, `_dualproj.py`, the shared
`_utils/dual_cone.py` and `_utils/qp.py`) against the exact QP (numpy enumeration
of active sets, quadprog's stored numbers)."""

import os

import keras
import numpy as np
import pytest

from keras_fastgrad import aggregators
from tests.aggregator_references import (
    REFERENCES,
    compiled,
    dualproj_np,
    float64_on_jax,  # noqa: F401  (autouse)
    gram_of,
    project_dual_cone_vector_np,
    rel_error,
    scaled_jacobian,
    upgrad_np,
)
from tests.multitask_helpers import (
    make_data,
)

# Under JAX each task count compiles programs of its own (~2 s each): one.
TASK_COUNTS = [2, 3, 4] if keras.backend.backend() == "tensorflow" else [3]


@pytest.mark.parametrize("num_tasks", [2, 3, 4])
@pytest.mark.parametrize("conflict", [0.3, 0.8])
def test_upgrad_and_dualproj_match_active_set_qp(num_tasks, conflict):
    J = scaled_jacobian(num_tasks, seed=num_tasks + int(10 * conflict), conflict=conflict)
    G = J @ J.T
    assert (G < 0).any()
    w = np.asarray(aggregators.get("upgrad").weights(gram_of(J)))
    np.testing.assert_allclose(w, upgrad_np(G), rtol=1e-7, atol=1e-10)
    w = np.asarray(aggregators.get("dualproj").weights(gram_of(J)))
    np.testing.assert_allclose(w, dualproj_np(G), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("num_tasks", TASK_COUNTS)
def test_upgrad_and_dualproj_are_the_dual_cone_projections(num_tasks):
    J = scaled_jacobian(num_tasks, seed=40 + num_tasks, conflict=0.7)
    options = {"norm_eps": 0.0, "reg_eps": 0.0}
    projections = [project_dual_cone_vector_np(J, g) for g in J]
    upgrad = np.asarray(aggregators.UPGrad(**options).weights(gram_of(J))) @ J
    np.testing.assert_allclose(upgrad, np.mean(projections, 0), rtol=1e-5, atol=1e-7)
    dualproj = np.asarray(aggregators.DualProj(**options).weights(gram_of(J))) @ J
    expected = project_dual_cone_vector_np(J, J.mean(0))
    np.testing.assert_allclose(dualproj, expected, rtol=1e-5, atol=1e-7)
    for merged in (upgrad, dualproj):  # no task is made worse
        assert (J @ merged >= -1e-10 * np.abs(J @ J.T).max()).all()
    assert (J @ J.mean(0) < 0).any()  # while the mean makes one worse


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_no_conflict_is_the_mean(name):
    J = np.abs(scaled_jacobian(3, seed=3))  # positive entries: every G_ij > 0
    agg = aggregators.get(name)
    np.testing.assert_allclose(
        np.asarray(type(agg)(reg_eps=0.0).weights(gram_of(J))), np.full(3, 1 / 3), rtol=1e-12
    )


def test_dual_cone_solver_hard_case_float32():
    # Nearly opposite, very unequal gradients: an ill-conditioned QP.
    J = scaled_jacobian(4, seed=9, conflict=0.95)
    J[3] = -0.99 * J[2] + 0.01 * J[3]
    G = J @ J.T
    for name, ref in (("upgrad", upgrad_np), ("dualproj", dualproj_np)):
        w = np.asarray(aggregators.get(name).weights(G.astype(np.float32)))
        np.testing.assert_allclose(w, ref(G), rtol=1e-3, atol=1e-5)


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

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "data",
        f"{name}_max_iter_v0.1.0.keras",
    )
    model = keras.models.load_model(path)  # saved by v0.1.0: config has `max_iter`
    assert type(model.multitask) is type(aggregators.get(name))
    assert "max_iter" not in model.multitask.get_config()
    x, y = make_data()
    model.train_on_batch(x, y)
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_weights_are_the_exact_qp_solution(name):
    # Old: 200 capped sweeps: UPGrad 0.028 off in float64, 0.044 in float32;
    # DualProj 0.072 in float32 (now 6e-14 and 6e-5 at most).
    agg = aggregators.get(name)
    for case in REFERENCES:
        G, ref = np.array(case["gram"]), np.array(case[name])
        assert rel_error(np.asarray(agg.weights(G)), ref) <= 1e-9, case["kind"]
        w32 = np.asarray(agg.weights(G.astype(np.float32)))
        assert rel_error(w32, ref) <= 2e-4, (case["kind"], case["num_tasks"])


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_weights_do_not_depend_on_task_order_or_xla(name):
    # Old: task order changed the weights by up to 0.11 (UPGrad, float64).
    agg = aggregators.get(name)
    xla = compiled(agg.weights)
    rng = np.random.default_rng(0)
    for case in REFERENCES:
        if case["num_tasks"] != 8:
            continue
        G = np.array(case["gram"])
        perm = rng.permutation(len(G))
        for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-4)):
            w = np.asarray(agg.weights(G.astype(dtype)))
            wp = np.asarray(agg.weights(G[np.ix_(perm, perm)].astype(dtype)))
            assert rel_error(wp, w[perm]) <= tol, case["kind"]
            assert rel_error(np.asarray(xla(G.astype(dtype))), w) <= tol, case["kind"]


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_without_normalisation_or_ridge_never_raises(name):
    # Old: InvalidArgumentError on a zero Gram.
    agg = type(aggregators.get(name))(norm_eps=0.0, reg_eps=0.0)
    for G in (np.zeros((3, 3)), np.ones((3, 3)), np.diag([1.0, 0.0, 1e-30])):
        for dtype in (np.float32, np.float64):
            assert np.isfinite(np.asarray(agg.weights(G.astype(dtype)))).all()
    np.testing.assert_allclose(
        np.asarray(agg.weights(np.zeros([3, 3], np.float32))), np.full(3, 1 / 3)
    )
