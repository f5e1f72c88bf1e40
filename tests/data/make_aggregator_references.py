"""Makes `aggregator_references.json`: reference weights from quadprog.

An independent reference for the aggregators' quadratic programs: the
Goldfarb-Idnani dual active-set method of `quadprog` (the solver torchjd
uses), in float64, on a fixed set of seeded Gram matrices. Not run by the
tests (they read the JSON file); run it again after changing the cases:

    python3 -m venv /tmp/qpenv && /tmp/qpenv/bin/pip install quadprog numpy
    /tmp/qpenv/bin/python tests/data/make_aggregator_references.py

Made with quadprog 0.1.14, numpy 2.x (see the file's "versions" entry).

Stored per case: the Gram `G` (float64) and
- `upgrad`, `dualproj`: torchjd's weights, `G / trace G + 1e-4 I`
  (`norm_eps=1e-4`, `reg_eps=1e-4`; every case has `trace G >= 1e-4`);
- `upgrad_noreg`, `dualproj_noreg`: the same with `reg_eps=0` (only where
  `G` is well enough conditioned for quadprog: full rank);
- `mgda`: `argmin_{w in simplex} w^T G w` (full-rank cases only).
"""

import json
import os
from importlib import metadata

import numpy as np
import quadprog


def dual_cone(G, u):
    """`argmin v^T G v s.t. v >= u` (quadprog: min 1/2 x^T P x - q^T x,
    s.t. C^T x >= b)."""
    T = len(u)
    return quadprog.solve_qp(2.0 * G, np.zeros(T), np.eye(T), np.asarray(u, float))[0]


def simplex_min_norm(G):
    T = len(G)
    C = np.concatenate([np.ones((T, 1)), np.eye(T)], axis=1)  # first: equality
    b = np.concatenate([[1.0], np.zeros(T)])
    return quadprog.solve_qp(2.0 * G, np.zeros(T), C, b, meq=1)[0]


def torchjd_gram(G, reg_eps):
    return G / np.trace(G) + reg_eps * np.eye(len(G))


def upgrad(G, reg_eps):
    Gn, T = torchjd_gram(G, reg_eps), len(G)
    return sum(dual_cone(Gn, np.eye(T)[i] / T) for i in range(T))


def dualproj(G, reg_eps):
    T = len(G)
    return dual_cone(torchjd_gram(G, reg_eps), np.full(T, 1.0 / T))


def jacobian(kind, T, rng):
    P = 2 * T + 2
    J = rng.normal(size=(T, P))
    J[1:] -= rng.uniform(0.3, 1.2) * J[0]  # conflicts with task 0
    spread = {"spread": 4.0}.get(kind, 1.5)  # log10 of the norm spread
    J *= 10.0 ** rng.uniform(-spread, spread, size=(T, 1))
    if kind == "rank_deficient":
        J = rng.normal(size=(T, max(1, T // 2))) @ J[: max(1, T // 2)]
    elif kind == "duplicate":
        J[-1] = J[0]
    elif kind == "zero_task":
        J[min(1, T - 1)] = 0.0
    elif kind == "opposite":
        J[-1] = -2.0 * J[0]
    return J


KINDS = ("random", "spread", "rank_deficient", "duplicate", "zero_task", "opposite")


def main():
    rng = np.random.default_rng(20261201)
    cases = []
    for T in range(2, 9):
        for kind in KINDS:
            J = jacobian(kind, T, rng)
            G = J @ J.T
            G = (G + G.T) / 2
            case = {"kind": kind, "num_tasks": T, "gram": G.tolist()}
            case["upgrad"] = upgrad(G, 1e-4).tolist()
            case["dualproj"] = dualproj(G, 1e-4).tolist()
            if kind in ("random", "spread") and np.linalg.cond(G) < 1e10:
                case["upgrad_noreg"] = upgrad(G, 0.0).tolist()
                case["dualproj_noreg"] = dualproj(G, 0.0).tolist()
                case["mgda"] = simplex_min_norm(G).tolist()
            cases.append(case)
    versions = {"quadprog": metadata.version("quadprog"), "numpy": np.__version__}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aggregator_references.json")
    with open(path, "w") as f:
        json.dump({"versions": versions, "cases": cases}, f, indent=0)
    print(f"{len(cases)} cases -> {path}")


if __name__ == "__main__":
    main()
