"""What the aggregator tests share: random task Jacobians, their Gram
matrices, and the numpy references the aggregators are checked against.

The references are written from the papers and the official code, not
from `keras_fastgrad.aggregators` (vectors in numpy float64, scipy's
solvers, brute force over active sets), plus quadprog's solutions stored
in `data/aggregator_references.json` (made by
`data/make_aggregator_references.py`; no quadprog at test time).

Used by `aggregators/test_*.py` and the multi-task tests
(`multitask/test_*.py`: `pcgrad_np`, `mgda_np`). Backend-neutral: the
aggregator tests run under TensorFlow and JAX (`compiled` and
`float64_on_jax` are the two differences they see).
"""

import itertools
import json
import os

import keras
import numpy as np
import pytest
from keras import ops
from scipy.optimize import least_squares, minimize

P = 50  # parameters per task gradient (`random_jacobian`)
P_SMALL = 12  # ... (`scaled_jacobian`)

# The aggregators added after the first five (their shared checks in
# test_registry.py, their model steps in test_in_models.py).
NEW = ("upgrad", "dualproj", "config", "gradvac", "nashmtl")

# quadprog's weights on seeded Grams: see data/make_aggregator_references.py.
with open(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "aggregator_references.json"),
    encoding="utf-8",
) as _f:
    REFERENCES = json.load(_f)["cases"]


# ------------------------------------------------------------- the backends
def compiled(fn, jit_compile=True):
    """`fn` traced and compiled: TensorFlow's `tf.function` (XLA with
    `jit_compile=True`, a graph with `False`), or `jax.jit` under JAX."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=jit_compile)


@pytest.fixture(autouse=True)
def float64_on_jax():
    """Under JAX, 64-bit types for the test (JAX turns them off by default:
    a float64 Gram would become float32), as TensorFlow has them. Imported
    by the test modules that compare float64 weights (an autouse fixture
    applies to the modules that import it)."""
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    with jax.enable_x64(True):
        yield


def jit_matches_eager_under_jax(agg, num_tasks=4, seed=11):
    """Asserts that `agg`'s weights are finite and the same from a
    `jax.jit`-compiled call and an eager one, on a conflicting float32 Gram
    with JAX's default 32-bit types (as in a JAX training step)."""
    import jax

    J = scaled_jacobian(num_tasks, seed=seed, conflict=0.7)
    G = (J @ J.T).astype(np.float32)
    with jax.enable_x64(False):
        eager = np.asarray(agg.weights(G))
        jitted = np.asarray(jax.jit(agg.weights)(G))
    assert eager.dtype == np.float32 and jitted.dtype == np.float32
    assert eager.shape == (num_tasks,) and np.isfinite(eager).all(), eager
    np.testing.assert_allclose(jitted, eager, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------- Jacobians and Grams
def random_jacobian(num_tasks, seed, conflict=0.0, size=P):
    """Random `J` (T x size); `conflict > 0` pulls tasks 1.. against task 0."""
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, size))
    J[1:] -= conflict * J[0]
    return J


def scaled_jacobian(num_tasks, seed, conflict=0.0, size=P_SMALL):
    """`random_jacobian`, each task's row scaled by a factor in [0.5, 3]."""
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(num_tasks, size))
    J[1:] -= conflict * J[0]
    return J * rng.uniform(0.5, 3.0, size=(num_tasks, 1))


def gram_of(J, dtype="float64"):
    """The Gram matrix `J J^T` as a tensor of the backend (`dtype`: a name,
    or a TensorFlow or NumPy dtype)."""
    return ops.convert_to_tensor(J @ J.T, keras.backend.standardize_dtype(dtype))


def merged_of(w, J):
    """The merged gradient `w^T J` in float64."""
    return np.asarray(w, np.float64) @ J


def rel_error(w, ref):
    """Largest absolute difference relative to the largest `|ref|`."""
    return np.max(np.abs(np.asarray(w, np.float64) - ref)) / np.max(np.abs(ref))


# ------------------------------------------------------------------- PCGrad
def pcgrad_np(J, orders):
    """Yu et al. (2020), Algorithm 1, on the gradient vectors themselves.

    `J` is T x P (one task gradient per row); `orders[i]` is the visiting
    order of the other tasks for task i. The merged gradient is the sum of
    the projected task gradients.
    """
    merged = np.zeros(J.shape[1])
    for i in range(len(J)):
        g = J[i].copy()
        for j in orders[i]:
            dot = g @ J[j]
            if dot < 0:
                g = g - dot / (J[j] @ J[j]) * J[j]
        merged += g
    return merged


# --------------------------------------------------------------------- MGDA
def mgda_np(gram):
    """min_{w in simplex} w^T G w, exactly: KKT on every support set."""
    num, best = len(gram), (np.inf, None)
    for size in range(1, num + 1):
        for support in itertools.combinations(range(num), size):
            s = list(support)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size], kkt[:size, size], kkt[size, :size] = gram[np.ix_(s, s)], 1, 1
            try:
                sol = np.linalg.solve(kkt, np.r_[np.zeros(size), 1.0])
            except np.linalg.LinAlgError:
                continue
            if np.all(sol[:size] >= -1e-12):
                w = np.zeros(num)
                w[s] = sol[:size]
                if w @ gram @ w < best[0]:
                    best = (w @ gram @ w, w)
    return best[1]


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


# ------------------------------------------------------------------- CAGrad
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


# -------------------------------------------------------------------- IMTL-G
def imtl_np(J):
    """IMTL-G closed form (Liu et al., 2021) on explicit vectors."""
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    D = J[0] - J[1:]
    Ud = U[0] - U[1:]
    alpha = J[0] @ Ud.T @ np.linalg.inv(D @ Ud.T)
    alpha = np.concatenate([[1 - alpha.sum()], alpha])
    return alpha @ J, U


def imtl_pinv_np(G):
    """IMTL-G from a Gram matrix as torchjd generalises it, numpy float64:
    `w = pinv(G) d / sum(pinv(G) d)`, `d` the task gradient norms, numpy's
    default (array API) cut-off `T eps`; zeros when the sum vanishes."""
    G = np.asarray(G, np.float64)
    v = np.linalg.pinv(G, rtol=None) @ np.sqrt(np.diag(G))
    return np.zeros_like(v) if abs(v.sum()) < 1e-12 else v / v.sum()


# --------------------------------------------------------------- Aligned-MTL
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


# ---------------------------------------------------------- UPGrad, DualProj
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


# ------------------------------------------------------------------- ConFIG
def config_np(J):
    """Official `ConFIG_update` (conflictfree): pinv of the unit gradients
    times ones, made unit, scaled by the sum of projections."""
    U = J / np.linalg.norm(J, axis=1, keepdims=True)
    best = np.linalg.pinv(U) @ np.ones(len(J))
    unit = best / np.linalg.norm(best)
    return np.sum(J @ unit) * unit


# ------------------------------------------------------------------ GradVac
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


# ------------------------------------------------------------------ Nash-MTL
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
