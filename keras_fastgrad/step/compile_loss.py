"""The one place that reaches into Keras' `CompileLoss` output losses.

`CompileLoss` matches `y`, `y_pred` and `sample_weight` structures and then
calls one loss object per output (`compat.output_losses`). The step needs to see
each of those calls (the per-task values for multi-task merging, the loss
normalisers for exact weighting) without re-implementing the matching: it
swaps the loss objects for wrappers while the model computes its loss.

(The TensorFlow step also keeps Keras' per-output `<output>_loss` metrics
as they were when a micro-batch is dropped:
`keras_fastgrad.backend.tensorflow.compile_loss`.)

It also tells the loss's other terms apart (`loss_terms`: the weight
regularisation, the layers' own losses), which the step weights on their
own where micro-batches are combined, or refuses where it cannot weight
them exactly (`check_extra_terms`; docs/concepts/exactness.md). This reads
Keras' private `Layer._get_own_losses` and `_flatten_layers`, as
`Layer.losses` does.
"""

import collections
import contextlib

import keras

from keras_fastgrad import _compat as compat


@contextlib.contextmanager
def wrapped_output_losses(model, wrap):
    """Within the block, each output loss `entry.loss` is `wrap(entry)`.

    Nests: an inner block wraps the outer block's wrappers. Works before
    `CompileLoss` is built (it builds on its first call): the wrappers are
    installed right after that build.

    Args:
        model: A compiled `keras.Model` (without compiled loss: no-op).
        wrap: Callable `entry -> callable(y_true, y_pred, sample_weight)`;
            `entry` has `path`, `loss`, `loss_weights`, `name`.

    Yields:
        The list of the original entries (filled once installed).
    """
    compile_loss = compat.compile_loss(model)
    originals = []
    if compile_loss is None:
        yield originals
        return

    def install():
        originals[:] = compat.output_losses(compile_loss)
        compat.set_output_losses(
            compile_loss, [entry._replace(loss=wrap(entry)) for entry in originals]
        )

    try:
        with compat.once_built(compile_loss, install):
            yield originals
    finally:
        if originals:
            compat.set_output_losses(compile_loss, originals)


class LossTerms(
    collections.namedtuple("LossTerms", ["total", "compiled", "weights", "rows", "known"])
):
    """The training loss and its parts, as `keras.Model.compute_loss` sums them.

    Fields:
        total: The loss, as Keras computes it.
        compiled: The compiled output losses' total (`None` if unknown).
        weights: The weight regularisation (a per-update constant), or `None`.
        rows: The layers' own losses (activity regularisers, `add_loss`
            terms: per-row means by Keras' convention), or `None`.
        known: Python bool, whether the parts are known (`False`: an
            overridden `compute_loss`, or `model.losses` overridden).
    """


def default_compute_loss(model):
    """Whether `model` computes its loss with Keras' own `compute_loss`."""
    return type(model).compute_loss is keras.Model.compute_loss and not compat.losses_overridden(
        model
    )


def layer_losses(model):
    """The layers' own losses (`add_loss`, activity regularisers), in the
    order of `model.losses`. Call after the forward pass."""
    losses = list(compat.own_losses(model))
    for layer in compat.flatten_layers(model, include_self=False):
        losses.extend(compat.own_losses(layer))
    return losses


def regularized_variables(model):
    """The trainable variables whose regulariser `model.losses` counts."""
    return [v for v in model.trainable_weights if getattr(v, "regularizer", None) is not None]


def loss_terms(model, x, y, y_pred, sample_weight, forward=None):
    """The training loss and its parts (a `LossTerms`).

    Without terms beyond the output losses, or with an overridden
    `compute_loss`, the loss is computed exactly as Keras' step does (no
    other op). Otherwise the parts are summed as `keras.Model.compute_loss`
    sums them: the compiled loss, the layers' losses, the weight
    regularisation.

    Args:
        model: The compiled model, called on `x` (its forward pass done).
        x, y, y_pred, sample_weight: The batch and its predictions.
        forward: `None` (the layers hold their losses: TensorFlow), or the
            list of `model.losses` a stateless forward returned (Keras' JAX
            `stateless_call(..., return_losses=True)`: the layers' losses,
            then one weight penalty per regularised variable).
    """
    if not default_compute_loss(model):
        with compat.forward_losses(model, forward):
            total = compat.compute_loss(model, x, y, y_pred, sample_weight)
        return LossTerms(total, None, None, None, False)
    rows, weights = _extra_terms(model, forward)
    if not rows and not weights:
        total = compat.compute_loss(model, x, y, y_pred, sample_weight)
        return LossTerms(total, total, None, None, True)
    compile_loss = compat.compile_loss(model)
    compiled = None if compile_loss is None else compile_loss(y, y_pred, sample_weight)
    rows = [compat.additional_loss(model, loss) for loss in rows]
    weights = [compat.additional_loss(model, loss) for loss in weights]
    parts = ([] if compiled is None else [compiled]) + rows + weights
    total = parts[0] if len(parts) == 1 else keras.ops.sum(parts)
    add = lambda ts: None if not ts else (ts[0] if len(ts) == 1 else keras.ops.sum(ts))  # noqa: E731
    compiled = keras.ops.zeros((), total.dtype) if compiled is None else compiled
    return LossTerms(total, compiled, add(weights), add(rows), True)


def _extra_terms(model, forward):
    """`(rows, weights)`: the layers' losses and the weight penalties, read
    from the layers or split from a stateless forward's `model.losses`
    (`loss_terms`)."""
    regularized = regularized_variables(model)
    if forward is None:
        return layer_losses(model), [v.regularizer(v) for v in regularized]
    forward = list(forward)
    split = len(forward) - len(regularized)
    return forward[:split], forward[split:]


def present_terms(model):
    """Which terms beyond the output losses the model's last forward pass
    had: a `LossTerms` whose parts are placeholders (`0.0` where present),
    for a step that does not sum them itself (the multi-task step, which
    weights its regularisation as one term; Keras' JAX forward, whose
    stateless call leaves only the ids of the layers' losses). Call after
    the forward pass."""
    present = lambda found: 0.0 if found else None  # noqa: E731
    rows = any(compat.has_own_losses(layer) for layer in compat.flatten_layers(model))
    weights = regularized_variables(model)
    return LossTerms(None, None, present(weights), present(rows), default_compute_loss(model))


def check_present_terms(model, share):
    """`check_extra_terms` of `present_terms` under the model's combining
    options (`weighting.forward_with_share`'s check: a forward that does
    not sum the terms itself).

    Args:
        model: The `FastGradModel`, after its forward pass.
        share: The micro-batch's `weighting.Share`.
    """
    step_state = model.fastgrad_step_state
    options = step_state.options.combining()
    merged = step_state.merger is not None
    check_extra_terms(model, share, options, present_terms(model), merged=merged)


def check_extra_terms(model, share, options, terms, merged=False):
    """Raises where the step cannot weight the loss's terms beyond the
    output losses exactly when micro-batches are combined (a trace-time
    check: Python only).

    Exact: the weight regularisation under a mean reduction (each
    micro-batch's weight `D_j` sums to the window's normaliser), and under
    `reduction="sum"` with `micro_batches` (counted once per batch); the
    layers' losses (per-row means) when the normaliser counts rows, and
    under `reduction="sum"` with `micro_batches` (weighted by the slice's
    share of the rows).

    Args:
        model: The `FastGradModel`.
        share: The micro-batch's `weighting.Share`.
        options: The combining options, e.g. `["accumulation_steps=4"]`.
        terms: The micro-batch's `LossTerms`.
        merged: Python bool, the multi-task step (its regularisation
            weighted as one term).
    """
    accumulating = any(o.startswith("accumulation_steps") for o in options)
    found, why = [], None
    if not terms.known:
        if share.mean and share.by_rows:
            return
        found = [f"the terms `{type(model).__name__}.compute_loss` adds"]
        why = "which terms an overridden `compute_loss` adds is unknown"
    elif share.mean:
        if terms.rows is not None and not share.by_rows:
            found = _row_terms(model)
            why = (
                "the layers' losses are per-row means, which the output loss's "
                "normaliser does not count"
            )
    else:
        if accumulating and (terms.rows is not None or terms.weights is not None):
            found = _row_terms(model) + _weight_terms(model)
            why = (
                "a window's number of rows and of micro-batches is not known "
                "before its last micro-batch"
            )
        elif merged and terms.rows is not None:
            found = _row_terms(model)
            why = "the multi-task step weights regularisation as one term"
    if not found:
        return
    raise ValueError(
        f"`{', '.join(options)}` cannot weight the loss's terms beyond the "
        f"output losses exactly under {share.describe}: {why}. Terms "
        f"found: {', '.join(found)}. Received: {', '.join(options)} with "
        f"{share.describe}. Fix: compile the loss with "
        '`reduction="sum_over_batch_size"` (without a mask on the output '
        "loss), or move the terms into a compiled output loss, or use "
        "`accumulation_steps=1` and `micro_batches=1` (one batch per update)."
    )


def _row_terms(model):
    names = []
    for layer in compat.flatten_layers(model):
        if compat.has_own_losses(layer):
            regularizer = getattr(layer, "activity_regularizer", None)
            kind = "activity regulariser" if regularizer is not None else "add_loss"
            names.append(f"{kind} of layer '{layer.name}'")
    return names


def _weight_terms(model):
    return [f"weight regulariser of '{v.path}'" for v in regularized_variables(model)]
