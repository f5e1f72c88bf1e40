"""Multi-task merging in representation space (`multitask_space="features"`).

The parameter-space merge (`keras_fastgrad.multitask`) differentiates every
task down to the first layer: `T` backward passes through the trunk. Here the
aggregator sees the gradients with respect to the shared representation `Z`
(the trunk's output) instead, as MGDA-UB does (Sener & Koltun 2018, "upper
bound"; LibMTL's `rep_grad`):

1. one forward pass; the output `Z` of the shared layer is cut from the graph
   (`stop_gradient`) and watched, so each task's backward stops at `Z`:
   `dZ_t = dL_t / dZ`, head only;
2. the Gram matrix `G[s, t] = <dZ_s, dZ_t>` (summed over the batch and over
   the replicas: the global batch's `Z` is the replicas' rows stacked) goes
   to the aggregator, whose weights `w` are constants;
3. ONE trunk backward pass with the cotangent `sum_t w_t dZ_t`: the trunk
   gets `sum_t w_t dL_t/dtheta` (for fixed `w` the exact gradient of
   `sum_t w_t L_t`: only the weights are approximated);
4. every path that does not pass through `Z` keeps its plain gradient: the
   heads get `sum_t dL_t/dphi`; a variable used both upstream of `Z` and
   directly by a head (a tied embedding) gets its merged part through `Z`
   plus its plain direct part; the regularisation gradient is added as in
   parameter space.

Cost: `T` head backward passes and one trunk backward pass, against `T`
full backward passes in parameter space.

Finding `Z`: `FastGradModel(multitask_features="layer_name")` names the
layer whose output is `Z` (all its floating outputs; needed for subclassed
models). Otherwise, for a functional model, `Z` is the deepest tensor every
model output depends on (`find_features`). The layer must run once per
forward pass; its output is captured by wrapping its `call` for the duration
of the step's forward pass (at trace time: no cost per step).

Example:

>>> inputs = keras.Input((4,))
>>> trunk = keras.layers.Dense(8, activation="tanh", name="trunk")(inputs)
>>> outputs = {"a": keras.layers.Dense(1, name="a")(trunk),
...            "b": keras.layers.Dense(1, name="b")(trunk)}
>>> model = keras_fastgrad.FastGradModel(
...     inputs, outputs, multitask="mgda", multitask_space="features")
>>> find_features(model)
('trunk', 0)
>>> model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
>>> x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
>>> history = model.fit(x, {"a": x[:, :1], "b": -x[:, :1]}, verbose=0)

References:
    Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization",
    NeurIPS 2018, https://arxiv.org/abs/1810.04650 (Section 3.3, MGDA-UB).
    Lin & Zhang, "LibMTL: A Python Library for Multi-Task Learning", JMLR
    2023 (`rep_grad=True`).
"""

import contextlib
import threading

import tensorflow as tf
from keras.src import tree
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

from keras_fastgrad._gradients import to_float32
from keras_fastgrad._replicas import num_replicas, replica_sum

SPACES = ("parameters", "features")

_LOCK = threading.Lock()
_THREAD = threading.local()  # MirroredStrategy traces replicas in threads
_INSTALLED = {}  # id(layer) -> [users, previous instance `call` or _MISSING]
_MISSING = object()


# ------------------------------------------------------------- finding Z
def find_features(model):
    """The shared representation of a functional model: `(layer, index)`.

    Walks the functional graph back from every model output, keeps the
    tensors all of them depend on (the model inputs excluded) and returns
    the deepest one (the longest path from the inputs): the last tensor
    common to every task's path, normally the trunk's output.

    Args:
        model: A functional `keras.Model` with several outputs.

    Returns:
        `(layer_name, output_index)`: `Z` is the `output_index`-th (flat)
        output of the layer named `layer_name`.

    Raises:
        ValueError: if the outputs share no tensor but the inputs, if two
            shared tensors are equally deep, or if the layer producing `Z`
            runs more than once per forward pass. Each message names the
            fix: `multitask_features="<layer name>"`.

    Example:

    >>> inputs = keras.Input((3,))
    >>> h = keras.layers.Dense(4, name="h1")(inputs)
    >>> h = keras.layers.Dense(4, name="h2")(h)
    >>> model = keras.Model(inputs, [keras.layers.Dense(1)(h),
    ...                              keras.layers.Dense(1)(h)])
    >>> find_features(model)
    ('h2', 0)
    """
    outputs = tree.flatten(model.outputs)
    inputs = {id(t) for t in tree.flatten(model.inputs)}
    depth, common = {}, None
    for output in outputs:
        reached = _ancestors(output, depth)
        common = reached if common is None else common & reached
    tensors = {id(t): t for o in outputs for t in _walk(o)}
    common = [tensors[i] for i in (common or set()) - inputs]
    if not common:
        _refuse(
            model, "the outputs share no layer (only the inputs)", "compute "
            "the tasks from a shared trunk, or use "
            "`multitask_space=\"parameters\"`"
        )
    deepest = max(depth[id(t)] for t in common)
    candidates = [t for t in common if depth[id(t)] == deepest]
    if len(candidates) > 1:
        names = sorted(t._keras_history[0].name for t in candidates)
        _refuse(model, f"several shared tensors are equally deep (outputs of "
                f"{names})", "name the layer to use, e.g. "
                f"`multitask_features={names[0]!r}`")
    layer, _, index = candidates[0]._keras_history
    calls = sum(
        node.operation is layer
        for nodes in model._nodes_by_depth.values() for node in nodes
    )
    if calls > 1:
        _refuse(model, f"the shared tensor comes from layer `{layer.name}`, "
                f"which runs {calls} times per forward pass", "name a layer "
                "that runs once with `multitask_features=\"<layer name>\"`")
    return layer.name, index


def _walk(tensor):
    seen, stack = {}, [tensor]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen[id(t)] = t
        operation, node_index, _ = t._keras_history
        stack.extend(operation._inbound_nodes[node_index].input_tensors)
    return list(seen.values())


def _ancestors(tensor, depth):
    """Ids of `tensor` and the tensors it depends on; fills `depth`."""
    found = _walk(tensor)
    for t in found:
        _graph_depth(t, depth)
    return {id(t) for t in found}


def _graph_depth(tensor, depth):
    if id(tensor) not in depth:
        operation, node_index, _ = tensor._keras_history
        parents = operation._inbound_nodes[node_index].input_tensors
        depth[id(tensor)] = 1 + max(
            (_graph_depth(p, depth) for p in parents), default=-1
        )
    return depth[id(tensor)]


def _refuse(model, reason, fix):
    raise ValueError(
        "`multitask_space=\"features\"` merges the tasks' gradients with "
        "respect to the representation all tasks share (`Z`): the deepest "
        f"tensor every output depends on. For model `{model.name}`, {reason}. "
        f"Received: multitask_features=None. Fix: {fix}."
    )


def _named_layer(model, name):
    layers = list(model._flatten_layers(include_self=False, recursive=True))
    found = [layer for layer in layers if layer.name == name]
    if len(found) > 1:
        raise ValueError(
            f"`multitask_features` must name one layer. Received: "
            f"multitask_features={name!r}, the name of {len(found)} layers. "
            "Fix: give the trunk's last layer a unique `name`."
        )
    if found:
        return found[0]
    names = [layer.name for layer in layers]
    raise ValueError(
        "`multitask_features` must name a layer of the model (its output is "
        f"the shared representation). Received: multitask_features={name!r}; "
        f"the model's layers: {names[:30]}{' ...' if len(names) > 30 else ''}. "
        "Fix: pass the name of the trunk's last layer."
    )


# ------------------------------------------------------------- capturing Z
class Capture:
    """Context manager around the forward pass that captures `Z`.

    While active (in this thread), each call of the shared layer records its
    output `Z` and hands the rest of the model `stop_gradient(Z)`, watched
    by `tape`: task backward passes stop at `Z` (see the module docstring).

    Args:
        model: A `FastGradModel` with `multitask_space="features"`.
        tape: The step's `tf.GradientTape`, recording the forward pass.
    """

    active = True

    def __init__(self, model, tape):
        self.model, self.tape = model, tape
        name = model.multitask_features
        if name is None:
            name, index = find_features(model)
            self.indices = [index]
        else:
            self.indices = None  # every floating output of the layer
        self.layer = _named_layer(model, name)
        self.features, self.cut, self.calls = [], [], 0

    def __enter__(self):
        _install(self.layer)
        active = vars(_THREAD).setdefault("captures", {})
        self._previous = active.get(id(self.layer))
        active[id(self.layer)] = self
        return self

    def __exit__(self, *exc):
        _THREAD.captures[id(self.layer)] = self._previous
        _uninstall(self.layer)

    def record(self, outputs):
        self.calls += 1
        if self.calls > 1:
            raise ValueError(
                "`multitask_features` must name a layer that runs once per "
                f"forward pass. Received: multitask_features={self.layer.name!r}"
                ", which ran more than once. Fix: name the layer whose single "
                "output all tasks read."
            )
        flat = list(tree.flatten(outputs))
        indices = self.indices
        if indices is None:
            indices = [i for i, t in enumerate(flat) if tf.is_tensor(t)
                       and t.dtype.is_floating]
        for i in indices:
            cut = tf.stop_gradient(flat[i])
            self.tape.watch(cut)
            self.features.append(flat[i])
            self.cut.append(cut)
            flat[i] = cut
        return tree.pack_sequence_as(outputs, flat)

    def merger(self, task_merger):
        """A callable with `TaskMerger.__call__`'s signature (see `merge`)."""
        return lambda *args, **kwargs: merge(self, task_merger, *args, **kwargs)


def capture(model, tape):
    """`Capture(model, tape)` in features space, else a no-op context."""
    if getattr(model, "multitask_space", "parameters") != "features":
        return _NoCapture()
    return Capture(model, tape)


class _NoCapture(contextlib.nullcontext):
    active = False


def _install(layer):
    with _LOCK:
        entry = _INSTALLED.get(id(layer))
        if entry is not None:
            entry[0] += 1
            return
        previous = vars(layer).get("call", _MISSING)
        original = layer.call

        def call(*args, **kwargs):
            outputs = original(*args, **kwargs)
            active = getattr(_THREAD, "captures", {}).get(id(layer))
            if active is None or in_symbolic_scope():  # Keras' shape inference
                return outputs
            return active.record(outputs)

        object.__setattr__(layer, "call", call)  # no Keras tracking
        _INSTALLED[id(layer)] = [1, previous]


def _uninstall(layer):
    with _LOCK:
        entry = _INSTALLED[id(layer)]
        entry[0] -= 1
        if entry[0]:
            return
        del _INSTALLED[id(layer)]
        if entry[1] is _MISSING:
            object.__delattr__(layer, "call")
        else:
            object.__setattr__(layer, "call", entry[1])


# ------------------------------------------------------------------ merge
def merge(capture, merger, tape, task_losses, regularization, variables,
          unscale=None, grad_scale=None, task_names=None):
    """Merged float32 gradients, as `TaskMerger.__call__` but in `Z` space.

    Args and returns as `keras_fastgrad.multitask.TaskMerger.__call__`;
    `capture` holds `Z` and its cut copy, `merger` the aggregator and the
    telemetry variables (`TaskMerger.weigh`).
    """
    if not capture.cut:
        raise ValueError(
            "`multitask_features` must name a layer that runs in the forward "
            f"pass. Received: multitask_features={capture.layer.name!r}, "
            "which did not run. Fix: name the trunk's last layer."
        )
    num_tasks = len(task_losses)
    names = task_names or [f"task_{i}" for i in range(num_tasks)]
    merger.build(names)
    unscale = unscale or (lambda grads: grads)
    sources = [v.value for v in variables]
    cut, count = capture.cut, len(capture.cut)

    direct, dz = [None] * len(sources), []  # paths that skip Z: plain
    for name, loss in zip(names, task_losses):
        grads = tape.gradient(loss, cut + sources)  # head only
        if any(g is None for g in grads[:count]):
            raise ValueError(
                "`multitask_features` must name a layer on every task's path. "
                f"Received: multitask_features={capture.layer.name!r}; task "
                f"{name!r} does not read its output. Fix: name a layer all "
                "outputs depend on (the trunk's last layer)."
            )
        dz.append(grads[:count])
        direct = _add(direct, grads[count:])
    dz_extra = [None] * count  # e.g. an activity regulariser on Z itself
    if regularization is not None:
        grads = tape.gradient(regularization, cut + sources)
        dz_extra, direct = grads[:count], _add(direct, grads[count:])

    # Gram over Z (flattened: summed over the batch), of the unscaled dZ_t.
    flat = tf.stack([
        tf.concat([tf.reshape(g, [-1]) for g in _float32(unscale(d))], 0)
        for d in dz
    ])
    gram = tf.matmul(flat, flat, transpose_b=True)
    if num_replicas() > 1:  # the global batch's Gram: one small all-reduce
        gram, grad_scale = replica_sum([gram, grad_scale])
    if grad_scale is not None:
        gram = gram / tf.square(tf.cast(grad_scale, tf.float32))
    weights, info = merger.weigh(gram)

    # ONE trunk backward, in the scaled domain (float16 keeps its range).
    cotangents = []
    for k, z in enumerate(capture.features):
        c = tf.add_n([w * tf.cast(d[k], tf.float32)
                      for w, d in zip(tf.unstack(weights), dz)])
        if dz_extra[k] is not None:
            c += tf.cast(dz_extra[k], tf.float32)
        cotangents.append(tf.cast(c, z.dtype))
    trunk = tape.gradient(capture.features, sources, output_gradients=cotangents)
    grads = _add(_float32(unscale(direct)), _float32(unscale(trunk)))
    return grads, {"gram": gram, "weights": weights, **info}


def _add(a, b):
    return [x if y is None else (y if x is None else _sum(x, y))
            for x, y in zip(a, b)]


def _sum(x, y):
    if isinstance(x, tf.IndexedSlices) and isinstance(y, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([x.values, y.values], 0),
                                tf.concat([x.indices, y.indices], 0), x.dense_shape)
    return tf.convert_to_tensor(x) + tf.convert_to_tensor(y)


def _float32(grads):
    return [to_float32(g) for g in grads]
