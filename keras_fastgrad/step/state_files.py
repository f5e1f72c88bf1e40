"""`StepState`'s values restored: from its entry of `.keras` / `.weights.h5`
files, and across a rebuild of its units (`carry`).

The core state (the telemetry, divergence and accumulation variables, in
`StepState.variables` order) is saved as `"0"`, `"1"`, ... (the layout
files saved before the optional units existed have), then each optional
unit's variables as `"<unit>_0"`, ... (`state.OPTIONAL`), so that a file
with or without them loads into a model with or without them; then, with
accumulation, what the traced step knew of the window (which variables get
no gradient, whether the loss is a mean: `NO_GRADIENT_KEY`,
`MEAN_REDUCTION_KEY`), so that a loaded model applies a pending window as
the saved one would have. The
optional units load only once the core state has: a core state that does
not fit (another `accumulation_steps`, other variables) warns and starts
the whole step state fresh, the weights loaded either way.
"""

import warnings

import numpy as np

from keras_fastgrad.step import accumulation

# The units with state only some models have (`StepState`'s attributes),
# saved under keys of their own, in this order.
OPTIONAL = ("batchnorm", "noise_scale")

# What the traced step knew of a pending window, saved beside it so that a
# loaded model can apply it before any step is traced (`window_facts`).
NO_GRADIENT_KEY = "window_no_gradient"
MEAN_REDUCTION_KEY = "window_mean_reduction"


def save(state, store):
    """Writes `state`'s variables into `store` (a file's entry)."""
    for i, v in enumerate(state.variables[: _core_size(state)]):
        store[str(i)] = v.numpy()
    for name, unit in state.named_units():
        for i, v in enumerate(unit.variables):
            store[f"{name}_{i}"] = v.numpy()
    facts = state.window_facts()
    if facts is not None:
        no_gradient, mean_reduction = facts
        store[NO_GRADIENT_KEY] = np.asarray(no_gradient, np.int8)
        store[MEAN_REDUCTION_KEY] = np.asarray(int(mean_reduction), np.int8)


def load(state, store):
    """Restores `state`'s variables from `store` (`{"0": array, ...}`)."""
    core = state.variables[: _core_size(state)]
    saved = {k: v for k, v in store.items() if "_" not in k}
    if state.accumulator is not None and len(saved) == len(core) - 1:
        saved = _without_included_count(saved, len(core))
    if len(saved) != len(core):
        warnings.warn(
            f"FastGradModel: the saved step state has {len(saved)} "
            f"variables but this model's has {len(core)} (different "
            "`accumulation_steps`, `batchnorm_statistics` or trainable "
            "variables?). The accumulation window and counters start "
            "fresh; the weights were loaded."
        )
        for _, unit in state.named_units():  # of no window it belongs to
            unit.reset_state()
        return
    for i, v in enumerate(core):
        v.assign(saved[str(i)])
    _load_optional(state, store)
    _load_window_facts(state, store)


def _load_window_facts(state, store):
    """The traced step's facts of the window, where the file has them
    (files saved before they were kept lack them: the flush then treats
    every variable as having a gradient, and a mean reduction)."""
    if NO_GRADIENT_KEY in store and MEAN_REDUCTION_KEY in store:
        no_gradient = [bool(b) for b in np.asarray(store[NO_GRADIENT_KEY]).reshape(-1)]
        state.set_window_facts(no_gradient, bool(np.asarray(store[MEAN_REDUCTION_KEY])))


def _core_size(state):
    optional = sum(len(unit.variables) for _, unit in state.named_units())
    return len(state.variables) - optional


def _load_optional(state, store):
    """Loads the optional units' variables (`"<unit>_<i>"` keys). A unit
    the file lacks, or holds with other shapes, starts fresh (zeros: an
    empty window, no estimate yet); a unit the file has but this model
    lacks is skipped (BatchNorm's pooled moments of an unfinished window:
    warned, they are lost)."""
    for name, unit in state.named_units():
        saved = [store.get(f"{name}_{i}") for i in range(len(unit.variables))]
        if all(
            value is not None and tuple(np.shape(value)) == tuple(v.shape)
            for v, value in zip(unit.variables, saved)
        ):
            for v, value in zip(unit.variables, saved):
                v.assign(value)
        else:
            unit.reset_state()
    own = {name for name, _ in state.named_units()}
    pooled = [v for k, v in store.items() if k.startswith("batchnorm_")]
    if "batchnorm" not in own and any(np.any(v) for v in pooled):
        warnings.warn(
            "FastGradModel: the file holds BatchNorm moments pooled over an "
            "unfinished window (`batchnorm_statistics='window'`), which this "
            "model does not pool; they are dropped (the moving statistics "
            "are as saved). The weights and the rest of the step state "
            "were loaded."
        )


def _without_included_count(store, size):
    """A file saved before the accumulator counted its included
    micro-batches (its last variable): a window with a positive
    normaliser held at least one (what was decided by then)."""
    normaliser = store[str(size - 3)]  # ..., normaliser, micro_step
    return {**store, str(size - 1): accumulation.included_of_old_file(normaliser)}


# ------------------------------------------------------- across a rebuild
def held_values(state, ids):
    """The built units' values (numpy) by unit, and the variables they
    were built for (`None` before `build`): what a rebuild carries."""
    if ids is None:
        return None
    held = {"ids": ids, "facts": state.facts}
    for name in ("telemetry", "divergence", "accumulator") + OPTIONAL:
        unit = getattr(state, name)
        held[name] = None if unit is None else [v.numpy() for v in unit.variables]
    if state.accumulator is not None:
        held["mean_reduction"] = state.accumulator.mean_reduction
    return held


def carry(state, old, ids):
    """Carries the state over a rebuild, so that nothing the user
    trained is lost when the trainable variables change (a layer frozen
    or unfrozen, then recompiled): the counters, the divergence streak,
    the optional units (where their shapes are unchanged), and the
    pending window. A variable that keeps training keeps its window
    sum; one that stops training loses its own (freezing it means its
    pending gradient is not applied); one that starts training starts
    from zero: its window gradient holds the micro-batches since, each
    weighted by its share of the whole window."""
    for name in ("telemetry", "divergence") + OPTIONAL:
        unit, values = getattr(state, name), old[name]
        if unit is None or values is None:
            continue
        if [tuple(v.shape) for v in unit.variables] == [np.shape(x) for x in values]:
            for v, value in zip(unit.variables, values):
                v.assign(value)
    acc, values = state.accumulator, old["accumulator"]
    if acc is None or values is None:
        return
    old_sums, scalars = values[: len(old["ids"])], values[len(old["ids"]) :]
    by_id = dict(zip(old["ids"], old_sums))
    for total, i in zip(acc.sums, ids):
        if i in by_id:
            total.assign(by_id[i])
    for v, value in zip(acc.variables[len(acc.sums) :], scalars):
        v.assign(value)
    acc.mean_reduction = old["mean_reduction"]
    facts = old["facts"]
    if facts is not None and tuple(old["ids"]) != tuple(ids):
        # Until the next trace: a variable that starts training has
        # nothing in the window (no gradient), the others as traced.
        none_by_id = dict(zip(old["ids"], facts.grad_is_none))
        state.facts = facts._replace(grad_is_none=[none_by_id.get(i, True) for i in ids])
