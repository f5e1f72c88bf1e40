"""Finding and capturing the shared representation `Z` of a model.

`find_features` walks a functional graph; `Capture` wraps the chosen
layer's `call` for the duration of one forward pass (trace time) and cuts
`Z` from the graph (the cut itself is the backend's: `hand_on`). Used by
`keras_fastgrad.multitask.feature_space` (TensorFlow:
`keras_fastgrad.backend.tensorflow.features`; JAX:
`keras_fastgrad.backend.jax.features`).
"""

import threading

import keras
from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._validation import check_ran_once

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
            model,
            "the outputs share no layer (only the inputs)",
            'compute the tasks from a shared trunk, or use `multitask_space="parameters"`',
        )
    deepest = max(depth[id(t)] for t in common)
    candidates = [t for t in common if depth[id(t)] == deepest]
    if len(candidates) > 1:
        names = sorted(compat.keras_history(t)[0].name for t in candidates)
        _refuse(
            model,
            f"several shared tensors are equally deep (outputs of {names})",
            f"name the layer to use, e.g. `multitask_features={names[0]!r}`",
        )
    layer, _, index = compat.keras_history(candidates[0])
    calls = sum(
        node.operation is layer for nodes in compat.nodes_by_depth(model).values() for node in nodes
    )
    if calls > 1:
        _refuse(
            model,
            f"the shared tensor comes from layer `{layer.name}`, "
            f"which runs {calls} times per forward pass",
            'name a layer that runs once with `multitask_features="<layer name>"`',
        )
    return layer.name, index


def _walk(tensor):
    seen, stack = {}, [tensor]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen[id(t)] = t
        stack.extend(compat.parent_tensors(t))
    return list(seen.values())


def _ancestors(tensor, depth):
    """Ids of `tensor` and the tensors it depends on; fills `depth`."""
    found = _walk(tensor)
    for t in found:
        _graph_depth(t, depth)
    return {id(t) for t in found}


def _graph_depth(tensor, depth):
    if id(tensor) not in depth:
        parents = compat.parent_tensors(tensor)
        depth[id(tensor)] = 1 + max((_graph_depth(p, depth) for p in parents), default=-1)
    return depth[id(tensor)]


def _refuse(model, reason, fix):
    raise ValueError(
        '`multitask_space="features"` merges the tasks\' gradients with '
        "respect to the representation all tasks share (`Z`): the deepest "
        f"tensor every output depends on. For model `{model.name}`, {reason}. "
        f"Received: multitask_features=None. Fix: {fix}."
    )


def _named_layer(model, name):
    layers = [l for l in compat.flatten_layers(model) if l is not model]
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
    output `Z` (`features`: the output found by `find_features`, or every
    floating output of the layer named by `multitask_features`) and hands
    the rest of the model `hand_on(Z, k)` instead: the backend's cut
    (TensorFlow: `stop_gradient(Z)` watched by the tape; JAX:
    `stop_gradient(Z) + delta_k`), so that the task backward passes stop at
    `Z` (see `keras_fastgrad.multitask.feature_space`). The layer must run
    once per forward pass.

    Args:
        model: A `FastGradModel` with `multitask_space="features"`.
    """

    def __init__(self, model):
        self.model = model
        name = model.multitask_features
        if name is None:
            name, index = find_features(model)
            self.indices = [index]
        else:
            self.indices = None  # every floating output of the layer
        self.layer = _named_layer(model, name)
        self.features, self.calls = [], 0

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
        """The layer's `outputs` with each `Z` recorded and replaced by
        `hand_on(Z, k)`."""
        self.calls += 1
        check_ran_once(self.calls, self.layer.name)
        flat = list(tree.flatten(outputs))
        indices = self.indices
        if indices is None:
            indices = [i for i, t in enumerate(flat) if _floating(t)]
        for k, i in enumerate(indices):
            self.features.append(flat[i])
            flat[i] = self.hand_on(flat[i], k)
        return tree.pack_sequence_as(outputs, flat)

    def check_ran(self):
        """Refuses a shared layer that did not run in the forward pass."""
        if not self.features:
            raise ValueError(
                "`multitask_features` must name a layer that runs in the forward "
                f"pass. Received: multitask_features={self.layer.name!r}, "
                "which did not run. Fix: name the trunk's last layer."
            )

    def refuse_task(self, task_name):
        """Refuses the shared layer because task `task_name`'s loss does
        not read `Z`."""
        raise ValueError(
            "`multitask_features` must name a layer on every task's path. "
            f"Received: multitask_features={self.layer.name!r}; task "
            f"{task_name!r} does not read its output. Fix: name a layer all "
            "outputs depend on (the trunk's last layer)."
        )

    def hand_on(self, z, k):
        """What the rest of the model reads in place of the `k`-th `Z`
        (the backend's cut: a subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} must define `hand_on`.")


def _floating(value):
    dtype = getattr(value, "dtype", None)
    return dtype is not None and keras.backend.is_float_dtype(
        keras.backend.standardize_dtype(dtype)
    )


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
            if active is None or compat.in_symbolic_scope():  # Keras' shape inference
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
