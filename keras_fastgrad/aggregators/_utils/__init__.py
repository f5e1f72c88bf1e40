"""What several aggregators share: the numerics (`numerics.py`), the
exact active-set QP (`qp.py`), pairwise Frank-Wolfe on the simplex
(`frank_wolfe.py`) and the dual-cone projection (`dual_cone.py`)."""
