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

The rules (the Gram over `Z`, the cotangents) are
`keras_fastgrad.step.multitask`'s; how `Z` is cut and the passes are taken
is the backend's (`keras_fastgrad.backend.tensorflow.features`, whose
`capture` `TaskMerger.capture` returns; `keras_fastgrad.backend.jax.features`).

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

from keras_fastgrad.multitask.representation import Capture, find_features  # noqa: F401

SPACES = ("parameters", "features")
