"""`TaskMerger.merge`: its result against numpy, and what its graph costs.

The result is checked against a numpy reference that builds the Jacobian of
each group of tasks explicitly (`J_k`, one row per task reaching variable
`k`) and forms `G = sum_k E_k J_k J_k^T E_k^T` and `w^T J_k` the textbook
way. The cost is checked on the traced graph, not by timing: the large
tensors the merge writes are at most one `[T, P_k]` copy of the task
gradients (the stack the Gram matmul and `w^T J` read) and the merged
gradient per shared variable, nothing else.

`TaskMerger` is the TensorFlow step's merge (tf ops, `IndexedSlices`, a
`tf.function` graph): its tests are TensorFlow's. The JAX step's merge
(`keras_fastgrad.maths.multitask`, `keras.ops`) is checked against the same
numpy reference on both backends (`test_maths_merge_matches_numpy...`).
"""

import numpy as np
import pytest
from keras import ops

from keras_fastgrad import aggregators
from keras_fastgrad.maths import multitask as maths

TENSORFLOW_MERGE = pytest.mark.tensorflow_only(
    reason="TaskMerger is the TensorFlow step's merge (tf ops, IndexedSlices, a tf.function "
    "graph); JAX's is keras_fastgrad.maths.multitask, tested below on both backends"
)


class RowSums(aggregators.Aggregator):
    """w = 1 + G 1 / trace(G): every Gram entry moves the weights."""

    name = "row_sums"

    def _weights(self, gram):
        return 1.0 + ops.sum(gram, axis=1) / ops.trace(gram)


def _row_sums_np(gram):
    return 1.0 + gram.sum(axis=1) / np.trace(gram)


SHAPES = [(5, 3), (3,), (4, 2), (7,), (2, 2)]
# Which of the 3 tasks reach each variable: all, tasks 0 and 1, task 2's
# own, tasks 1 and 2 (as an `IndexedSlices` gradient), nobody.
REACHING = [(0, 1, 2), (0, 1), (2,), (1, 2), ()]


def _gradients(seed=0):
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    values = [
        [rng.normal(size=s) if t in r else None for s, r in zip(SHAPES, REACHING)] for t in range(3)
    ]
    per_task = []
    for t in range(3):
        row = []
        for k, v in enumerate(values[t]):
            if v is None:
                row.append(None)
            elif k == 3:  # rows 1, 4 and 6 of a 7-vector, as an embedding lookup
                row.append(
                    tf.IndexedSlices(
                        tf.constant(v[[1, 4, 6]], tf.float32),
                        tf.constant([1, 4, 6]),
                        tf.constant([7]),
                    )
                )
                values[t][k] = np.where(np.isin(np.arange(7), [1, 4, 6]), v, 0.0)
            else:
                row.append(tf.constant(v, tf.float32))
        per_task.append(row)
    return per_task, values


def _reference(values, reg=None):
    num_tasks = len(values)
    gram = np.zeros((num_tasks, num_tasks))
    for k, reaching in enumerate(REACHING):
        if len(reaching) > 1:
            jac = np.stack([values[t][k].ravel() for t in reaching])  # [S, P_k]
            select = np.eye(num_tasks)[list(reaching)]  # [S, T]
            gram += select.T @ (jac @ jac.T) @ select
    w = _row_sums_np(gram)
    merged = []
    for k, reaching in enumerate(REACHING):
        if not reaching:
            merged.append(None)
        elif len(reaching) == 1:
            merged.append(values[reaching[0]][k])
        else:
            jac = np.stack([values[t][k].ravel() for t in reaching])
            merged.append((w[list(reaching)] @ jac).reshape(SHAPES[k]))
    if reg is not None:
        merged = [m if r is None else (r if m is None else m + r) for m, r in zip(merged, reg)]
    return gram, w, merged


@TENSORFLOW_MERGE
def test_merge_matches_numpy_for_partly_shared_and_sparse_gradients():
    import tensorflow as tf

    from keras_fastgrad.multitask.merger import TaskMerger

    per_task, values = _gradients()
    reg_np = [None, np.full((3,), 0.5), None, None, np.ones((2, 2))]
    reg = [None if r is None else tf.constant(r, tf.float32) for r in reg_np]
    merged, info = TaskMerger(RowSums()).merge(per_task, reg)
    gram, w, expected = _reference(values, reg_np)
    np.testing.assert_allclose(info["gram"].numpy(), gram, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(info["weights"].numpy(), w, rtol=1e-5)
    for got, want in zip(merged, expected):
        if want is None:
            assert got is None
        else:
            np.testing.assert_allclose(
                tf.convert_to_tensor(got).numpy(), want, rtol=1e-5, atol=1e-5
            )


@TENSORFLOW_MERGE
def test_merge_with_grad_scale_divides_the_gram_only():
    import tensorflow as tf

    from keras_fastgrad.multitask.merger import TaskMerger

    per_task, values = _gradients(seed=1)
    merged, info = TaskMerger(RowSums()).merge(per_task, share=tf.constant(2.0))
    scaled = [[None if v is None else v / 2.0 for v in row] for row in values]
    gram, w, _ = _reference(scaled)  # the true gradients' Gram and weights
    _, _, expected = _reference(values)
    np.testing.assert_allclose(info["gram"].numpy(), gram, rtol=1e-5, atol=1e-6)
    # The merged gradient keeps the factor: w (of the true Gram) times J.
    k = 0
    jac = np.stack([values[t][k].ravel() for t in REACHING[k]])
    np.testing.assert_allclose(merged[k].numpy().ravel(), w @ jac, rtol=1e-5, atol=1e-5)
    assert expected[2] is not None and np.allclose(merged[2].numpy(), expected[2])


def test_maths_merge_matches_numpy_for_partly_shared_gradients():
    # The JAX step's merge (`maths.multitask`, keras.ops): the reaching-task
    # split, the Gram matrix and `w^T J_k` against the numpy reference.
    values = _dense_gradients()
    own, groups = maths.split_by_reaching_tasks(REACHING)
    assert own == {2: 2} and groups == {(0, 1, 2): [0], (0, 1): [1], (1, 2): [3]}
    per_task = [
        [
            ops.zeros(s, "float32") if v is None else ops.convert_to_tensor(v, "float32")
            for s, v in zip(SHAPES, row)
        ]
        for row in values
    ]
    gram, stacked = maths.gram(per_task, groups, 3)
    weights = RowSums().weights(gram)
    merged = maths.merge(per_task, own, groups, stacked, weights)
    expected_gram, w, expected = _reference(values)
    np.testing.assert_allclose(ops.convert_to_numpy(gram), expected_gram, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(weights), w, rtol=1e-5)
    assert sorted(merged) == [k for k, want in enumerate(expected) if want is not None]
    for k, got in merged.items():
        np.testing.assert_allclose(ops.convert_to_numpy(got), expected[k], rtol=1e-5, atol=1e-5)


def _dense_gradients(seed=0):
    """Task gradients as `_gradients` draws them, dense (numpy; `None`
    where the task does not reach the variable)."""
    rng = np.random.default_rng(seed)
    values = [
        [rng.normal(size=s) if t in r else None for s, r in zip(SHAPES, REACHING)] for t in range(3)
    ]
    return values


# ---------------------------------------------------------------- the graph
VIEWS = {"Reshape", "Identity", "Placeholder", "Squeeze", "ExpandDims", "ReadVariableOp", "Const"}


def _merge_graph(num_tasks=4, shapes=((300, 200), (200,), (200, 100), (100,))):
    import tensorflow as tf

    from keras_fastgrad.multitask.merger import TaskMerger

    merger = TaskMerger("pcgrad")

    @tf.function(autograph=False)
    def merge(grads):
        return merger.merge(grads)[0]

    specs = [[tf.TensorSpec(s, tf.float32) for s in shapes] for _ in range(num_tasks)]
    graph = merge.get_concrete_function(specs).graph
    return graph, shapes


def _size(tensor):
    shape = tensor.shape
    return int(np.prod(shape.as_list())) if shape.rank else 1


@TENSORFLOW_MERGE
def test_merge_writes_at_most_one_copy_of_the_task_gradients():
    num_tasks = 4
    graph, shapes = _merge_graph(num_tasks)
    total = sum(int(np.prod(s)) for s in shapes)
    smallest = min(int(np.prod(s)) for s in shapes)
    written = sum(
        _size(out)
        for op in graph.get_operations()
        if op.type not in VIEWS
        for out in op.outputs
        if out.dtype.is_floating and _size(out) >= smallest
    )
    # The `[T, P_k]` stack of each shared variable and the merged gradient.
    assert written <= (num_tasks + 1) * total, written
