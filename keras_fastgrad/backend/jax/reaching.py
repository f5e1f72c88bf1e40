"""Which inputs of a traced JAX program each output depends on
differentiably: the multi-task step's reaching-task split on JAX.

On TensorFlow a variable no task loss reaches gets a `None` gradient from
the tape, and the merge (`keras_fastgrad.multitask.merger`) splits the
variables by the tasks that reach them. JAX returns zeros instead, so the
JAX step (`keras_fastgrad.backend.jax.multitask`) reads the same fact at
trace time from the program itself: the jaxpr of the task losses
(`jax.make_jaxpr`), walked forward from the inputs, one equation at a
time. An output of an equation depends on every input its inputs depend
on (conservative: never fewer), except where no gradient flows:

- `stop_gradient`'s output depends on nothing;
- an integer or boolean output (argmax, a comparison, a mask) depends on
  nothing (its gradient is not defined, as TensorFlow's is `None`);
- a call of a sub-program (`jit`, `custom_jvp_call`, `custom_vjp_call`,
  `remat`, ...) is walked inside; loops and branches (`scan`, `while`,
  `cond`) count as one equation.
"""

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from keras_fastgrad.backend.jax import forward as jax_forward
from keras_fastgrad.step.state import TraceFacts

# Primitives whose output carries no gradient of their input.
_NO_GRADIENT = ("stop_gradient",)
# Parameters holding the sub-program a call primitive runs on its inputs.
_CALLED = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def reaching_inputs(closed_jaxpr, num_outputs):
    """For each of the first `num_outputs` outputs, the inputs it depends
    on differentiably.

    Args:
        closed_jaxpr: A `ClosedJaxpr` (`jax.make_jaxpr(f)(*args)`).
        num_outputs: int, how many of its first outputs to report.

    Returns:
        A list of `num_outputs` sets of input positions (in the order of
        the jaxpr's flat inputs).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> def f(a, b, c):
    ...     shared = jnp.tanh(a)
    ...     return (jnp.sum(shared * b), jnp.sum(shared + jax.lax.stop_gradient(c)),
    ...             jnp.argmax(c))
    >>> closed = jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(2), jnp.ones(2))
    >>> reaching_inputs(closed, 3)
    [{0, 1}, {0}, set()]
    """
    jaxpr = closed_jaxpr.jaxpr
    masks = _walk(jaxpr, [1 << i for i in range(len(jaxpr.invars))])
    return [{i for i in range(len(jaxpr.invars)) if mask >> i & 1} for mask in masks[:num_outputs]]


def traced_program(program, *args):
    """Traces `program(*args)` once: `(closed_jaxpr, run)`.

    The multi-task steps read the reaching-task split from `closed_jaxpr`
    (`reaching_inputs`) and differentiate `run` (`jax.vjp`), which
    evaluates that same traced program, so the model's forward pass is
    traced once, not twice.

    Args:
        program: A function of JAX arrays (nested lists and tuples of
            them) returning a pytree.
        *args: Its example arguments (their shapes and dtypes are traced).

    Returns:
        `(closed_jaxpr, run)`: the `ClosedJaxpr` and `run(*args)`, which
        takes arguments structured as `args` (or the same leaves, flat)
        and returns `program`'s output structure.

    Example:

    >>> import jax.numpy as jnp
    >>> closed, run = traced_program(lambda a, bs: (a * bs[0], a + bs[1]),
    ...                              jnp.ones(2), [jnp.ones(2), jnp.ones(2)])
    >>> [float(v[0]) for v in run(jnp.full(2, 3.0), [jnp.full(2, 2.0), jnp.zeros(2)])]
    [6.0, 3.0]
    >>> reaching_inputs(closed, 2)
    [{0, 1}, {0, 2}]
    """
    closed, shapes = jax.make_jaxpr(program, return_shape=True)(*args)
    evaluate = jax_core.jaxpr_as_fun(closed)
    structure = jax.tree_util.tree_structure(shapes)

    def run(*inputs):
        return jax.tree_util.tree_unflatten(structure, evaluate(*jax.tree_util.tree_leaves(inputs)))

    return closed, run


def _walk(jaxpr, input_masks):
    """The outputs' dependency bit masks of `jaxpr` (a `Jaxpr`) given its
    inputs' (constants depend on nothing)."""
    env = dict(zip(jaxpr.invars, input_masks))

    def read(var):
        return 0 if isinstance(var, jax_core.Literal) else env.get(var, 0)

    for eqn in jaxpr.eqns:
        masks = [read(v) for v in eqn.invars]
        called = _called(eqn)
        if eqn.primitive.name in _NO_GRADIENT:
            outs = [0] * len(eqn.outvars)
        elif called is not None:
            outs = _walk(called, masks)
        else:
            union = 0
            for mask in masks:
                union |= mask
            outs = [union] * len(eqn.outvars)
        for var, mask in zip(eqn.outvars, outs):
            env[var] = mask if _differentiable(var) else 0
    return [read(v) for v in jaxpr.outvars]


def _called(eqn):
    """The `Jaxpr` a call equation runs on exactly its inputs (and returns
    exactly its outputs), else `None` (walked as one equation)."""
    for name in _CALLED:
        sub = eqn.params.get(name)
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if (
            sub is not None
            and hasattr(sub, "eqns")
            and len(sub.invars) == len(eqn.invars)
            and len(sub.outvars) == len(eqn.outvars)
        ):
            return sub
    return None


def _differentiable(var):
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def record_trace_facts(model, state, batch, traced):
    """The traced step's facts (`StepState.facts`, as TensorFlow's tape
    records them): how many variables the gradient is taken for and which
    of them the loss does not reach (read from the program of Keras'
    `compute_loss_and_updates` over the trainable values,
    `reaching_inputs`: one more trace of the forward pass).
    Only while `tape_variables` is requested (`TapeVariableCounter`,
    `telemetry=True`); a trace that does not look leaves no facts (`None`).
    Under `run_eagerly=True` (no trace) the first step looks, once.

    Args:
        model: The `FastGradModel`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        batch: `(x, y, sample_weight)`.
        traced: Python bool, whether the step is being traced (`jit`).
    """
    tv, ntv, ov, mv = state
    step_state = model.fastgrad_step_state
    if "tape_variables" not in step_state.log_keys:
        if traced:
            step_state.facts = None
        return
    if not traced and step_state.facts is not None:
        return

    def loss_of(trainable):
        return jax_forward.keras_loss(model, (trainable, ntv, mv, ov), batch)[0]

    reached = reaching_inputs(jax.make_jaxpr(loss_of)(list(tv)), 1)[0]
    grad_is_none = [i not in reached for i in range(len(tv))]
    step_state.facts = TraceFacts(
        tape_variables=len(tv),
        no_gradient=[v.path for v, none in zip(model.trainable_variables, grad_is_none) if none],
        grad_is_none=grad_is_none,
    )
