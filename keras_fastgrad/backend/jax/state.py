"""How the JAX step finds its state in Keras' state tuple.

Keras' JAX trainer threads four lists through `train_step(state, data)`:
the trainable, non-trainable, optimizer and metrics variables' values. The
step's own variables (`StepState`'s: the window, the counters, the
divergence streak) ride in the model's `non_trainable_variables` (the
model's property adds them after the layers' own; `model.weights` and the
files' layout stay those of TensorFlow). `Slots` finds each variable the
step reads by position, once per trace, so the step works on plain values
(no assignment inside a traced branch, which JAX cannot do).
"""

import math

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax.telemetry import optional_variables
from keras_fastgrad.step.divergence import DivergenceStop, TrainingLoss, loss_result
from keras_fastgrad.step.trainer import check_trainable_unchanged


class Slots:
    """Positions of the step's variables in the state tuple's lists.

    Args:
        model: The `FastGradModel` (its `StepState` built).
    """

    def __init__(self, model):
        state = model.fastgrad_step_state
        check_trainable_unchanged(model)
        ntv = model.non_trainable_variables
        where = {id(v): i for i, v in enumerate(ntv)}
        own = {id(v) for v in step_variables(model)}
        self.layer_ntv = [i for i, v in enumerate(ntv) if id(v) not in own]
        tel, acc = state.telemetry, state.accumulator
        self.ntv = {
            "updates": where[id(tel.updates)],
            "clipped_updates": where[id(tel.clipped_updates)],
            "grad_norm": where[id(tel.grad_norm)],
            "nonfinite_count": where[id(tel.nonfinite_count)],
            "streak": where[id(state.divergence.streak)],
            "first_index": where[id(tel.nonfinite_first_index)],
            "num_bad": where[id(tel.nonfinite_num_variables)],
            "shape_changes": where[id(tel.input_shape_changes)],
            "last_batch": where[id(tel.last_input_batch)],
            "last_size": where[id(tel.last_input_size)],
        }
        for key, variable in optional_variables(tel):  # `grad_norm/<layer>`, ...
            self.ntv[key] = where[id(variable)]
        self.sums = []
        if acc is not None:
            self.sums = [where[id(v)] for v in acc.sums]
            self.ntv.update(
                normaliser=where[id(acc.normaliser)],
                micro_step=where[id(acc.micro_step)],
                included=where[id(acc.included)],
            )
        optimizer = model.optimizer
        self.inner = getattr(optimizer, "inner_optimizer", optimizer)
        self.scaler = optimizer if self.inner is not optimizer else None
        ov = {id(v): i for i, v in enumerate(optimizer.variables)}
        self.inner_ov = [ov[id(v)] for v in self.inner.variables]
        self.ov = {}
        if self.scaler is not None:
            self.ov = {
                "scale": ov[id(self.scaler.dynamic_scale)],
                "counter": ov[id(self.scaler.step_counter)],
            }


def step_variables(model):
    """The step's variables once its state is built (`[]` before): what
    the model's `non_trainable_variables` adds on JAX (the saved ones,
    then the optional telemetry keys', which are not saved)."""
    state = vars(model).get("fastgrad_step_state")
    if state is None or state._built_for is None:
        return []
    optional = [v for _, v in optional_variables(state.telemetry)]
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


class JaxTrainingLoss(TrainingLoss):
    """`TrainingLoss` in `keras.ops` (its `result` is NaN for a period with
    nothing kept, or while micro-batches are being dropped)."""

    def result(self):
        mean = self.total / self.count
        streak = None if self._streak is None else self._streak()
        if streak is not None:
            streak = _value_or_none(streak)
        if streak is None:
            return mean
        return loss_result(mean, streak)


def _value_or_none(variable):
    """The variable's value: mapped in the step's scope, or synced after
    it; `None` inside a step that does not map it (a subclass's own step:
    Keras' JAX trainer has detached the value, and reading fails)."""
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
