"""How the JAX step finds its state in Keras' state tuple.

Keras' JAX trainer threads four lists through `train_step(state, data)`:
the trainable, non-trainable, optimizer and metrics variables' values. The
step's own variables (`StepState`'s: the window, the counters, the
divergence streak) ride in the model's `non_trainable_variables` (the
model's property adds them after the layers' own; `model.weights` and the
files' layout stay those of TensorFlow). `Slots` finds each variable the
step reads by position, once per trace, in the core's record of its unit
(`Counters`, `WindowState`, `Estimates`), and `StepValues` holds their
values in the same records, so the step works on plain values (no
assignment inside a traced branch, which JAX cannot do).
"""

import math
from typing import Any, NamedTuple

import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.accumulation import WindowState
from keras_fastgrad.step.divergence import DivergenceStop
from keras_fastgrad.step.noise_scale import Estimates
from keras_fastgrad.step.telemetry import Counters
from keras_fastgrad.step.trainer import check_trainable_unchanged


class ScaleSlots(NamedTuple):
    """Positions of `LossScaleOptimizer`'s state among the optimizer's
    variables' values.

    Attributes:
        scale: `dynamic_scale`'s.
        counter: `step_counter`'s.
    """

    scale: int
    counter: int


class Slots(NamedTuple):
    """Where the step finds its state in Keras' state tuple: the positions
    of the step's values in the non-trainable (`ntv`) and optimizer (`ov`)
    lists, one typed record per unit (the core's, holding positions
    instead of values). Built once per trace by `slots(model)`.

    Attributes:
        counters: `telemetry.Counters` of positions in `ntv`.
        streak: Position of the divergence streak in `ntv`.
        window: `accumulation.WindowState` of positions in `ntv` (`sums`
            a list), `None` without accumulation.
        measured: Tuple of `(key, position)`: the optional telemetry keys'
            values (`grad_norm/<layer>`, ...) in `ntv`.
        noise: `noise_scale.Estimates` of positions in `ntv`, `None`
            unless the noise scale is measured.
        inner: The optimizer that applies the update (inside a
            `LossScaleOptimizer`, its `inner_optimizer`).
        scaler: The `LossScaleOptimizer`, or `None`.
        inner_ov: List of the positions of `inner`'s values in `ov`.
        scale: `ScaleSlots` of the loss scale, `None` without `scaler`.
    """

    counters: Any
    streak: int
    window: Any
    measured: tuple
    noise: Any
    inner: Any
    scaler: Any
    inner_ov: list
    scale: Any

    def loss_scale(self, ov, default=None):
        """The loss scale's value in the optimizer values `ov`; `default`
        without loss scaling."""
        return default if self.scaler is None else ov[self.scale.scale]


def slots(model):
    """The `Slots` of `model` (its `StepState` built), after checking that
    its trainable variables are those the step was built for
    (`step.trainer.check_trainable_unchanged`)."""
    state = model.fastgrad_step_state
    check_trainable_unchanged(model)
    where = positions(model.non_trainable_variables)
    tel, acc, noise = state.telemetry, state.accumulator, state.noise_scale
    window = None
    if acc is not None:
        window = WindowState(_at(where, acc.sums), *_at(where, acc.state()[1:]))
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    scaler = optimizer if inner is not optimizer else None
    ov = positions(optimizer.variables)
    scale = None
    if scaler is not None:
        scale = ScaleSlots(*_at(ov, (scaler.dynamic_scale, scaler.step_counter)))
    return Slots(
        counters=Counters(*_at(where, tel.counters())),
        streak=where[id(state.divergence.streak)],
        window=window,
        measured=tuple((key, where[id(v)]) for key, v in tel.optional_variables()),
        noise=None if noise is None else Estimates(*_at(where, noise.state())),
        inner=inner,
        scaler=scaler,
        inner_ov=_at(ov, inner.variables),
        scale=scale,
    )


def positions(variables):
    """`{id(variable): position}` of the list `variables`."""
    return {id(v): i for i, v in enumerate(variables)}


def _at(where, variables):
    """The positions (`where`: `positions`') of `variables`."""
    return [where[id(v)] for v in variables]


class StepValues:
    """The step's own values while it runs, one typed record per unit
    (the core's records, of values): each unit replaces its field with its
    new values (a traced branch on JAX cannot assign). `read` makes it
    from the incoming `ntv`; `write` puts it back into the outgoing one.

    Attributes:
        counters: `telemetry.Counters` of float32 scalars.
        streak: float32 scalar, the divergence streak.
        window: `accumulation.WindowState` of values, or `None`.
        measured: Dict `{key: float32 scalar}` of the optional telemetry
            keys (the keys are the logs': `grad_norm/<layer>`, ...).
        noise: `noise_scale.Estimates` of values, or `None`.
    """

    __slots__ = ("counters", "streak", "window", "measured", "noise")

    def __init__(self, counters, streak, window, measured, noise):
        self.counters, self.streak, self.window = counters, streak, window
        self.measured, self.noise = measured, noise

    @classmethod
    def read(cls, slots, ntv):
        """The values at `slots`' positions of `ntv`."""
        window = None
        if slots.window is not None:
            sums, *scalars = slots.window
            window = WindowState([ntv[i] for i in sums], *(ntv[i] for i in scalars))
        return cls(
            Counters(*(ntv[i] for i in slots.counters)),
            ntv[slots.streak],
            window,
            {key: ntv[i] for key, i in slots.measured},
            None if slots.noise is None else Estimates(*(ntv[i] for i in slots.noise)),
        )

    def write(self, slots, out, ntv):
        """Writes the values into the list `out` at `slots`' positions, each
        scalar in its variable's dtype (`ntv`: the incoming values)."""
        scalars = [*zip(slots.counters, self.counters), (slots.streak, self.streak)]
        scalars += [(i, self.measured[key]) for key, i in slots.measured]
        if slots.noise is not None:
            scalars += zip(slots.noise, self.noise)
        if slots.window is not None:
            scalars += zip(slots.window[1:], self.window[1:])
            for i, total in zip(slots.window.sums, self.window.sums):
                out[i] = total
        for i, value in scalars:
            out[i] = ops.cast(value, ntv[i].dtype)
        return out


def step_variables(model):
    """The step's variables once its state is built (`[]` before): what
    the model's `non_trainable_variables` adds on JAX (the saved ones,
    then the optional telemetry keys', which are not saved)."""
    state = vars(model).get("fastgrad_step_state")
    if state is None or state._built_for is None:
        return []
    optional = [v for _, v in state.telemetry.optional_variables()]
    return state.variables + optional + multitask_variables(model)


def multitask_variables(model):
    """The `multitask` aggregator's variables (`[]` without one): its
    state (`state_variables`, built for the model's task count once the
    compiled loss knows it) and its seed generators' states (PCGrad's
    orders), which the JAX step threads through the state tuple."""
    state = vars(model).get("fastgrad_step_state")
    merger = None if state is None else state.merger
    if merger is None:
        return []
    aggregator = merger.aggregator
    compile_loss = compat.compile_loss(model)
    if compile_loss is not None and compile_loss.built:
        aggregator.build(len(compat.output_losses(compile_loss)))
    seeds = [
        v.state for v in vars(aggregator).values() if isinstance(v, keras.random.SeedGenerator)
    ]
    return list(aggregator.state_variables) + seeds


def streak_value(variable):
    """The divergence streak's value as the `loss` tracker reads it
    (`TrainingLoss`'s `streak`): mapped in the step's scope, or synced
    after it; `None` for `None` (evaluating), and inside a step that does
    not map it (a subclass's own step: Keras' JAX trainer has detached the
    value, and reading fails)."""
    if variable is None:
        return None
    try:
        return variable.value
    except TypeError:
        return None


class JaxDivergenceStop(DivergenceStop):
    """`DivergenceStop` on JAX: the model's state is synced to its
    variables (`Callback.model` does) before the streak is read, which it
    is only when the logged `loss` is not finite; not run on Keras'
    asynchronous callback thread (the sync must not race the step)."""

    async_safe = False

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if self.stopped or (isinstance(loss, float) and math.isfinite(loss)):
            return
        self.model  # noqa: B018 (JAX: syncs the state into the variables)
        super().on_train_batch_end(batch, logs)
