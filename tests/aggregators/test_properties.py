"""Properties every registered aggregator must have (torchjd's style).

Parametrized over `aggregators.NAMES`, so a new aggregator is covered as
soon as it is registered. Checked:

- finite weights on every finite Gram: random PSD Grams, zero, rank-deficient,
  duplicated, zero-gradient and opposite tasks; float64 at Gram scales
  `1e-40 .. 1e40` (gradient norms `1e-20 .. 1e20`) and float32 at
  `1e-20 .. 1e20` (float32 holds Gram entries from ~`1e-38` to `3e38`, so
  gradient norms from ~`1e-19` to `1e19`; the scales keep the entries,
  spread included, inside that range);
- XLA (`jit_compile=True`) equals eager;
- scale invariance for the methods that have it (all but CAGrad, whose
  official `1e-8` constants set a scale: it is checked only where they are
  negligible; UPGrad and DualProj with `norm_eps=0`, as their default
  `norm_eps=1e-4` zeroes a Gram of trace below `1e-4` on purpose);
- permutation equivariance (PCGrad with its orders permuted alike; GradVac
  is excepted: its tasks visit the others in a fixed increasing order);
- one task returns its gradient (each method's factor: 1, or CAGrad's
  `(1 + c) / (1 + c^2)` and Nash-MTL's `1 / sqrt(1 + reg_eps)`).

Then the methods' own properties: UPGrad and DualProj directions conflict
with no task and satisfy the QP's KKT conditions (checked in numpy), and
match quadprog's solutions (stored in `data/aggregator_references.json` by
`data/make_aggregator_references.py`: no quadprog at test time); MGDA
matches quadprog's min-norm point; ConFIG has equal cosines.

The errors are measured on the merged gradient, `||(w - w_ref)^T J||`
relative to `sum_i |w_ref_i| ||g_i||` (`_merged_error`): weights that are
not unique (duplicated tasks, a zero gradient) or that belong to a
gradient negligible at the dtype's precision do not count.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_fastgrad import aggregators
from keras_fastgrad.aggregators._utils import dual_cone as _cone_aggregators
from keras_fastgrad.aggregators._utils import qp as _qp
from tests.aggregator_references import (
    REFERENCES,
    compiled,
    float64_on_jax,  # noqa: F401  (autouse)
)

# Every case is checked against quadprog in test_dual_cone.py, test_mgda.py; the
# KKT checks here take T = 3, 5, 8 (each new T is a new trace).
SOME_REFERENCES = [c for c in REFERENCES if c["num_tasks"] in (3, 5, 8)]
TOL = {"float64": 1e-8, "float32": 2e-4}
# Methods with a rank cut-off (pinv, eigh) jump where an eigenvalue crosses
# it: on singular Grams float32 rounding moves them by more.
CUTOFF_METHODS = ("aligned", "config", "imtl")
SINGULAR = ("rank_deficient", "duplicate", "zero_task", "opposite")


def _tol(name, dtype, kind="random"):
    if dtype == "float32" and name in CUTOFF_METHODS and kind in SINGULAR:
        return 5e-3
    if dtype == "float64" and name == "cagrad":
        # Frank-Wolfe stops at a duality gap of 16 eps: the weights are
        # known to ~sqrt(16 eps) = 6e-8 (under JAX, XLA's sums round a
        # permuted G differently and the two runs stop 1.2e-8 apart).
        return 1e-7
    return TOL[dtype]


# Aligned-MTL's `eigh` under XLA (Jacobi sweeps) stops near 1e-8 relative in
# float64 and 1e-3 in float32 (not fixed here: the balance matrix has no
# refinement step yet).
XLA_TOL = {("aligned", "float64"): 1e-6, ("aligned", "float32"): 5e-3}
SCALE_INVARIANT = [n for n in aggregators.NAMES if n != "cagrad"]


def _jacobian(num_tasks, seed, kind="random", spread=1.5):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, 2 * num_tasks + 2))
    J[1:] -= rng.uniform(0.3, 1.2) * J[0]
    J *= 10.0 ** rng.uniform(-spread, spread, size=(num_tasks, 1))
    if kind == "rank_deficient":
        rank = max(1, num_tasks // 2)
        J = rng.normal(size=(num_tasks, rank)) @ J[:rank]
    elif kind == "duplicate":
        J[-1] = J[0]
    elif kind == "zero_task":
        J[min(1, num_tasks - 1)] = 0.0
    elif kind == "opposite":
        J[-1] = -2.0 * J[0]
    elif kind == "zero":
        J[:] = 0.0
    return J


KINDS = ("random", "rank_deficient", "duplicate", "zero_task", "opposite", "zero")


def _grams(num_tasks, seed=0):
    """The Gram of each kind, scaled so that `max(diag G) = 1`."""
    out = {}
    for i, kind in enumerate(KINDS):
        G = _jacobian(num_tasks, seed + 17 * i, kind) @ _jacobian(num_tasks, seed + 17 * i, kind).T
        top = np.max(np.diag(G))
        out[kind] = G / top if top > 0 else G
    return out


def _make(name, **options):
    if name in ("upgrad", "dualproj") and options.get("invariant"):
        return type(aggregators.get(name))(norm_eps=0.0)
    return aggregators.get(name)


def _fn(agg, jit=None):
    """`weights`, traced with `jit` not None (TensorFlow: XLA if `jit`, else
    a graph; JAX: `jax.jit`); PCGrad with fixed visiting orders (stateless
    draws are not the same numbers under XLA)."""
    if isinstance(agg, aggregators.PCGrad):

        def call(g):
            num_tasks = g.shape[0]
            orders = [[(i + k) % num_tasks for k in range(1, num_tasks)] for i in range(num_tasks)]
            return agg.weights(g, orders=np.array(orders, np.int32))
    else:
        call = agg.weights
    return compiled(call, jit_compile=jit) if jit is not None else call


def _graph(name):
    """`weights` of a fresh `name` aggregator, traced (not XLA on TensorFlow)."""
    return _fn(aggregators.get(name), jit=False)


def _merged_error(w, ref, gram):
    """`||(w - ref)^T J||` (from `G`) relative to `sum_i |ref_i| ||g_i||`,
    the scale of the rounding errors in `ref^T J`, plus `1e-4 ||ref||_1
    max_i ||g_i||` for merged gradients that nearly cancel."""
    G = np.asarray(gram, np.float64)
    norms = np.sqrt(np.maximum(np.diag(G), 0.0))
    w, ref = np.asarray(w, np.float64), np.asarray(ref, np.float64)
    delta = w - ref
    size = np.sum(np.abs(ref) * norms) + 1e-4 * np.sum(np.abs(ref)) * np.max(norms)
    return np.sqrt(max(delta @ G @ delta, 0.0)) / max(size, np.finfo(np.float64).tiny)


# ---------------------------------------------------------------- every method
@pytest.mark.parametrize("name", aggregators.NAMES)
def test_finite_weights_on_every_finite_gram(name):
    # The extremes here; test_scale_invariance covers T = 5 at every scale.
    fn = _graph(name)
    for dtype, scales in (("float64", [1e-40, 1e-20, 1e20, 1e40]), ("float32", [1e-20, 1e20])):
        for kind, G in _grams(8).items():
            for scale in scales:
                gram = (G * scale).astype(dtype)
                assert np.isfinite(gram).all()
                w = np.asarray(fn(gram))
                assert w.shape == (8,) and np.isfinite(w).all(), (kind, scale, w)


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_xla_equals_eager(name):
    grams = _grams(5, seed=3)
    cases = [(k, grams[k]) for k in ("random", "rank_deficient", "zero_task")]
    cases += [("random", grams["random"] * 1e-6), ("random", _grams(5, seed=4)["random"] * 1e6)]
    # float32, the training dtype (float64 under XLA: test_imtl.py
    # for the QP methods and IMTL; each compile costs seconds).
    for dtype in ("float32",):
        agg = aggregators.get(name)
        xla = _fn(agg, jit=True)
        for kind, G in cases:
            gram = G.astype(dtype)
            eager = np.asarray(_fn(agg)(gram))
            tol = XLA_TOL.get((name, dtype), _tol(name, dtype, kind))
            assert _merged_error(np.asarray(xla(gram)), eager, G) <= tol, (name, dtype, kind)


@pytest.mark.parametrize("name", SCALE_INVARIANT)
def test_scale_invariance(name):
    fn = (
        _fn(_make(name, invariant=True), jit=False)
        if name in ("upgrad", "dualproj")
        else _graph(name)
    )
    for dtype, scales in (("float64", [1e-40, 1e-8, 1e20, 1e40]), ("float32", [1e-20, 1e20])):
        for kind, G in _grams(5, seed=5).items():
            if kind == "zero":
                continue
            base = np.asarray(fn(G.astype(dtype)))
            for scale in scales:
                w = np.asarray(fn((G * scale).astype(dtype)))
                assert _merged_error(w, base, G) <= _tol(name, dtype, kind), (kind, scale, w, base)


def test_cagrad_is_scale_invariant_where_its_constants_are_negligible():
    fn = _fn(aggregators.CAGrad(), jit=False)
    G = _grams(5, seed=5)["random"]
    base = np.asarray(fn(G * 1e6))
    for scale in (1e10, 1e20, 1e40):
        w = np.asarray(fn(G * scale))
        assert _merged_error(w, base, G) <= 1e-6
    w = np.asarray(fn((G * 1e30).astype(np.float32)))  # entries near float32's top
    assert _merged_error(w, base, G) <= 1e-4


@pytest.mark.parametrize("name", [n for n in aggregators.NAMES if n != "gradvac"])
def test_permutation_equivariance(name):
    agg, fn = aggregators.get(name), _graph(name)
    rng = np.random.default_rng(6)
    for kind, G in _grams(5, seed=7).items():
        perm = rng.permutation(5)
        inverse = np.argsort(perm)
        permuted = G[np.ix_(perm, perm)]
        for dtype in ("float64", "float32"):
            if name == "pcgrad":  # the same visiting orders, renamed
                orders = np.array([[j for j in range(5) if j != i] for i in range(5)])
                w = np.asarray(agg.weights(G.astype(dtype), orders=orders))
                renamed = inverse[orders[perm]]
                wp = np.asarray(agg.weights(permuted.astype(dtype), orders=renamed))
            else:
                w = np.asarray(fn(G.astype(dtype)))
                wp = np.asarray(fn(permuted.astype(dtype)))
            tol = _tol(name, dtype, kind)
            if dtype == "float32" and name in CUTOFF_METHODS and kind in SINGULAR:
                tol = max(tol, 3 * _float32_sensitivity(fn, G))
            assert _merged_error(wp, w[perm], permuted) <= tol, (kind, dtype)


def _float32_sensitivity(fn, G, draws=8):
    """How far the EXACT (float64) answer moves when `G` moves by float32
    rounding (symmetric noise of `eps32 * max|G|`): the median merged error.
    No float32 computation can be closer than this to the exact answer, nor
    two of them to each other. (Aligned-MTL on the `duplicate` Gram: its
    eigenvalues 9e-7 and 3e-6 of the top one are within float32's reach of
    zero; the exact answer moves by 7e-3 median, 2e-2 at most, measured.)"""
    rng = np.random.default_rng(0)
    exact = np.asarray(fn(G.astype("float64")))
    errors = []
    for _ in range(draws):
        noise = rng.normal(size=G.shape) * np.finfo(np.float32).eps * np.abs(G).max()
        moved = np.asarray(fn((G + (noise + noise.T) / 2).astype("float64")))
        errors.append(_merged_error(moved, exact, G))
    return float(np.median(errors))


def _single_task_factor(agg):
    if isinstance(agg, aggregators.CAGrad):
        return (1.0 + agg.c) / (1.0 + agg.c**2)
    if isinstance(agg, aggregators.NashMTL):
        return 1.0 / np.sqrt(1.0 + agg.reg_eps)
    return 1.0


@pytest.mark.parametrize("name", aggregators.NAMES)
def test_one_task_returns_its_gradient(name):
    agg = aggregators.get(name)
    for dtype in ("float64", "float32"):
        # CAGrad's official 1e-8 constants shift its factor at small norms.
        for norm_sq in (1.0, 1e6) if name == "cagrad" else (1e-6, 1e6):
            w = np.asarray(_fn(agg)(np.array([[norm_sq]], dtype)))
            np.testing.assert_allclose(w, [_single_task_factor(agg)], rtol=1e-5)


# ------------------------------------------------------------ UPGrad, DualProj
def _kkt_violation(G, u, v):
    """Largest violation of the KKT conditions of `min v^T G v, v >= u`,
    relative to `max(diag G)` and `||v||_1`."""
    grad = G @ v
    size = max(np.max(np.diag(G)), 1e-300) * np.sum(np.abs(v))
    free = v > u
    return max(
        np.max(np.maximum(u - v, 0.0)) / np.sum(np.abs(v)),  # primal feasibility
        np.max(np.maximum(-grad[~free], 0.0), initial=0.0) / size,  # dual feasibility
        np.max(np.abs(grad[free]), initial=0.0) / size,  # stationarity
        np.max(np.abs((v - u) * grad)) / (size * np.sum(np.abs(v))),  # complementarity
    )


def _targets(name, num_tasks):
    if name == "upgrad":
        return np.eye(num_tasks) / num_tasks
    return np.full((1, num_tasks), 1.0 / num_tasks)


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dual_cone_solutions_satisfy_kkt_and_match_quadprog(name, dtype):
    solve = _qp.active_set_qp
    weights = {r: type(aggregators.get(name))(reg_eps=r).weights for r in (1e-4, 0.0)}
    for case in SOME_REFERENCES:
        G = np.array(case["gram"])
        for suffix, reg_eps in (("", 1e-4), ("_noreg", 0.0)):
            if name + suffix not in case:
                continue
            w = np.asarray(weights[reg_eps](G.astype(dtype)))
            ref = np.array(case[name + suffix])
            # The reference solves the float64 QP; float32 rounds G (cond up to 1e4).
            tol = 1e-10 if dtype == "float64" else 2e-3
            assert _merged_error(w, ref, G) <= tol, (case["kind"], case["num_tasks"], w, ref)
            gram = _cone_aggregators.normalized_regularized(
                ops.convert_to_tensor(G, dtype), 1e-4, reg_eps
            )
            targets = _targets(name, len(G)).astype(dtype)
            v, steps = solve(gram, targets)
            targets = targets.astype(np.float64)
            assert int(steps) < _qp.max_steps(len(G))  # the cap never ends a solve
            v = np.asarray(v)
            # Under JAX the weights come from one XLA program (fused: float32
            # rounds otherwise), the normalised Gram here from eager ops.
            jax = keras.backend.backend() == "jax"
            rtol = {"float64": 1e-12, "float32": 2e-4 if jax else 1e-6}
            np.testing.assert_allclose(v.sum(0), w, rtol=rtol[dtype])
            Gn = np.asarray(gram).astype(np.float64)
            kkt_tol = 1e-12 if dtype == "float64" else 1e-5
            for u, row in zip(targets, v.astype(np.float64)):
                assert _kkt_violation(Gn, u, row) <= kkt_tol, (case["kind"], len(G))


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_directions_conflict_with_no_task(name):
    weights = type(aggregators.get(name))(norm_eps=0.0, reg_eps=0.0).weights
    for case in SOME_REFERENCES:
        G = np.array(case["gram"])
        for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
            if dtype == "float32" and case["kind"] == "spread":
                # Norms 1e8 apart: the QP's free block has condition ~1e16,
                # beyond float32; float64 is checked.
                continue
            w = np.asarray(weights(G.astype(dtype))).astype(np.float64)
            assert np.isfinite(w).all()
            norms = np.sqrt(np.diag(G))
            # g_i . d >= -tol ||g_i|| sum_j |w_j| ||g_j|| (the rounding scale of d)
            assert np.all(G @ w >= -tol * norms * np.sum(np.abs(w) * norms)), case["kind"]


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dual_cone_without_normalisation_or_ridge_on_degenerate_grams(name, dtype):
    # UPGrad/DualProj(norm_eps=0, reg_eps=0) raised InvalidArgumentError on these.
    agg = type(aggregators.get(name))(norm_eps=0.0, reg_eps=0.0)
    for kind, G in _grams(4, seed=8).items():
        w = np.asarray(agg.weights(G.astype(dtype)))
        assert np.isfinite(w).all(), kind
        if kind == "zero":
            np.testing.assert_allclose(w, np.full(4, 0.25))


# ------------------------------------------------------------ MGDA, ConFIG
def test_mgda_matches_quadprog():
    fn = _fn(aggregators.MGDA(), jit=False)
    for case in REFERENCES:
        if "mgda" not in case:
            continue
        G = np.array(case["gram"])
        for dtype, tol in (("float64", 1e-9), ("float32", 1e-3)):
            w = np.asarray(fn(G.astype(dtype)))
            assert _merged_error(w, case["mgda"], G) <= tol, (case["kind"], len(G))


def test_config_has_equal_cosines():
    for case in REFERENCES:
        if case["kind"] not in ("random", "spread"):
            continue
        G = np.array(case["gram"])
        w = np.asarray(aggregators.ConFIG().weights(G))
        norms = np.sqrt(np.diag(G))
        cosines = (G @ w) / (norms * np.sqrt(w @ G @ w))
        np.testing.assert_allclose(cosines, cosines[0], rtol=1e-6)
