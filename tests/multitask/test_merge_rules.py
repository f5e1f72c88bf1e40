"""The multi-task merge's rules (`keras_fastgrad.step.multitask`, imported by
both backends' steps) against a numpy reference written differently: the
task gradients flattened into ONE vector over every variable (zeros where
a task does not reach), `G = J J^T` and `w^T J` the textbook way, instead
of the merge's per-variable, per-group sums. Runs on both backends.
"""

import numpy as np
import pytest
from keras import ops

from keras_fastgrad.step import multitask as core

SHAPES = [(3, 2), (4,), (2,), (5,), (2, 2)]
# Per variable, the tasks reaching it: all three; tasks 0 and 2; task 1's
# own; nobody; tasks 1 and 2.
REACHING = [(0, 1, 2), (0, 2), (1,), (), (1, 2)]


def _draw(seed=0):
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=s) if t in r else None for s, r in zip(SHAPES, REACHING)] for t in range(3)
    ]


def _tensors(values):
    return [
        [None if v is None else ops.convert_to_tensor(v, "float32") for v in row] for row in values
    ]


def _weights_np(gram):
    return 1.0 + gram.sum(axis=1) / np.trace(gram)


def _weigh(gram):
    return 1.0 + ops.sum(gram, axis=1) / ops.trace(gram), ()


def _flat_reference(values, share=1.0):
    """`(gram, weights, merged)`: the shared variables' gradients as one
    zero-filled vector per task."""
    shared = [k for k, r in enumerate(REACHING) if len(r) > 1]
    jac = np.stack(
        [
            np.concatenate(
                [(np.zeros(SHAPES[k]) if row[k] is None else row[k]).ravel() for k in shared]
            )
            for row in values
        ]
    )
    gram = jac @ jac.T / share**2
    w = _weights_np(gram)
    flat = w @ jac
    merged, offset = [], 0
    for k, reaching in enumerate(REACHING):
        if len(reaching) > 1:
            size = int(np.prod(SHAPES[k]))
            merged.append(flat[offset : offset + size].reshape(SHAPES[k]))
            offset += size
        elif len(reaching) == 1:
            merged.append(values[reaching[0]][k])
        else:
            merged.append(None)
    return gram, w, merged


def _check(got, want):
    assert len(got) == len(want)
    for g, v in zip(got, want):
        if v is None:
            assert g is None
        else:
            np.testing.assert_allclose(ops.convert_to_numpy(g), v, rtol=1e-5, atol=1e-5)


def test_merge_matches_the_flat_jacobian_reference():
    values = _draw()
    assert core.reaching_of(_tensors(values)) == REACHING
    result = core.merge(_tensors(values), REACHING, _weigh)
    gram, w, merged = _flat_reference(values)
    np.testing.assert_allclose(ops.convert_to_numpy(result.gram), gram, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(result.weights), w, rtol=1e-5)
    _check(result.grads, merged)
    assert result.new_state == ()


def test_share_divides_the_gram_and_the_merged_gradient_keeps_it():
    values = _draw(1)
    share = 4.0
    result = core.merge(_tensors(values), REACHING, _weigh, share=ops.convert_to_tensor(share))
    gram, w, merged = _flat_reference(values, share)
    np.testing.assert_allclose(ops.convert_to_numpy(result.gram), gram, rtol=1e-5, atol=1e-6)
    _check(result.grads, merged)  # `w` of the true Gram, times the carried gradients


def test_regularization_is_added_after_merging():
    values = _draw(2)
    reg = [np.full(SHAPES[0], 0.5), None, np.ones(SHAPES[2]), np.ones(SHAPES[3]), None]
    result = core.merge(_tensors(values), REACHING, _weigh, regularization=_tensors([reg])[0])
    _, _, merged = _flat_reference(values)
    expected = [m if r is None else (r if m is None else m + r) for m, r in zip(merged, reg)]
    _check(result.grads, expected)  # the variable nobody reaches: the regularisation's


def test_replicas_merge_the_global_gradients_and_return_each_replicas_part():
    # Two identical replicas: the sum doubles every shared task gradient and
    # the share; the Gram is the true one, each replica returns half of the
    # merged global gradient, an own gradient is left as it is.
    values = _draw(3)

    def replica_sum(tensors):
        return [None if t is None else t * 2.0 for t in tensors]

    result = core.merge(
        _tensors(values),
        REACHING,
        _weigh,
        share=ops.convert_to_tensor(1.0),
        replicas=2,
        replica_sum=replica_sum,
    )
    gram, _, merged = _flat_reference(values)
    np.testing.assert_allclose(ops.convert_to_numpy(result.gram), gram, rtol=1e-5, atol=1e-5)
    _check(result.grads, merged)


def test_fewer_than_two_tasks_are_refused():
    with pytest.raises(ValueError, match="at least two"):
        core.merge([[ops.ones((2,))]], [(0,)], _weigh)


@pytest.mark.parametrize(
    "merged, losses_finite, kept",
    [
        ([1.0, 2.0], True, True),
        ([1.0, np.nan], True, False),
        ([1.0, np.inf], None, False),
        ([1.0, 2.0], False, False),
        ([1.0, 2.0], None, True),
    ],
)
def test_a_stateful_aggregators_state_moves_only_where_finite(merged, losses_finite, kept):
    grads = [ops.convert_to_tensor(np.array(merged, "float32")), None]
    flag = None if losses_finite is None else ops.convert_to_tensor(losses_finite)
    keep = core.keep_state(grads, flag)
    assert bool(ops.convert_to_numpy(keep)) is kept
    old, new = np.zeros((2,), "float32"), np.ones((2,), "float64")
    (value,) = core.kept(keep, [ops.convert_to_tensor(new)], [ops.convert_to_tensor(old)])
    assert ops.convert_to_numpy(value).tolist() == (new if kept else old).tolist()
    assert ops.convert_to_numpy(value).dtype == np.float32  # the state's own dtype


def test_task_logs_worked_by_hand():
    # g_a = (2, 0), g_b = (-1, 0), g_c = 0: |g_a| = 2, |g_b| = 1,
    # cos(a, b) = -1, a zero gradient's cosines are 0, one conflicting pair.
    gram = ops.convert_to_tensor([[4.0, -2.0, 0.0], [-2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    logs = core.task_logs(["a", "b", "c"], core.task_telemetry(gram))
    got = {k: float(ops.convert_to_numpy(v)) for k, v in logs.items()}
    assert got == {
        "task_grad_norm/a": 2.0,
        "task_grad_norm/b": 1.0,
        "task_grad_norm/c": 0.0,
        "task_cosine/a/b": -1.0,
        "task_cosine/a/c": 0.0,
        "task_cosine/b/c": 0.0,
        "task_conflicts": 1.0,
    }
    assert core.names_or_default(None, 3) == ["task_0", "task_1", "task_2"]


def test_features_gram_and_cotangents_match_numpy():
    rng = np.random.default_rng(4)
    # Two outputs of the shared layer (`Z` = both), three tasks.
    dz_np = [[rng.normal(size=(4, 3)), rng.normal(size=(4,))] for _ in range(3)]
    dz = _tensors(dz_np)
    factor, share = 0.5, 2.0
    gram = core.features_gram(
        dz, factor=ops.convert_to_tensor(factor), share=ops.convert_to_tensor(share)
    )
    flat = np.stack([np.concatenate([g.ravel() for g in row]) for row in dz_np]) * factor
    np.testing.assert_allclose(
        ops.convert_to_numpy(gram), flat @ flat.T / share**2, rtol=1e-5, atol=1e-6
    )
    w = np.array([0.5, -1.0, 2.0])
    extra = [None, ops.ones((4,))]
    features = [ops.zeros((4, 3), "float16"), ops.zeros((4,), "float32")]
    cotangents = core.features_cotangents(ops.convert_to_tensor(w), dz, extra, features)
    for k, c in enumerate(cotangents):
        want = sum(w[t] * dz_np[t][k] for t in range(3)) + (1.0 if k == 1 else 0.0)
        assert ops.convert_to_numpy(c).dtype == ("float16" if k == 0 else "float32")
        np.testing.assert_allclose(ops.convert_to_numpy(c), want, rtol=2e-3, atol=2e-3)
