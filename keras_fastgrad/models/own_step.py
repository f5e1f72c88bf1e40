"""A `FastGradModel` subclass with a `train_step` of its own (a GAN with its
own tapes and optimizers): the options must not be silently ignored.

The options act inside `FastGradModel.train_step` (accumulation, clipping,
multi-task merging, slicing, the BatchNorm window, the non-finite drop and
its streak, telemetry); none acts outside it: the divergence stop and the
end-of-epoch flush only read what that step wrote. A step that never calls
it would train as if they were absent, so such a model is refused when any
option asks for something the step would do.

How it is found: `FastGradModel.__init_subclass__` wraps every `train_step`
a subclass defines (`guard`). The wrapper notes, per thread (each replica of
a `MirroredStrategy` runs the step in a thread of its own), whether
`FastGradModel.train_step` ran for this model during the call (`note_base_step`),
and raises if it did not and an option is set. The check reads what the
step did, not its source: `super().train_step(data)`,
`FastGradModel.train_step(self, data)`, a helper that calls either, or a
chain of overrides all count. Keras runs the step's Python once, when it
traces the train function: the error comes before the traced step ever
runs, so no weight moves. Under `run_eagerly=True` there is no trace; the
error comes after the first batch's step.
"""

import functools
import threading

# The values a step of the subclass's own already honours (it never skips a
# non-finite gradient, never stops a run): set, they are not ignored.
_HONOURED = {"skip_nonfinite": False, "max_consecutive_nonfinite": None}

_calls = threading.local()


def guard(step, defaults):
    """`step` (a subclass's `train_step`), refusing the options (`defaults`:
    their default values) it would ignore."""

    @functools.wraps(step)
    def train_step(self, *args, **kwargs):
        stack = vars(_calls).setdefault("stack", [])
        frame = [self, False]  # [model, whether its base step ran]
        stack.append(frame)
        try:
            outputs = step.__get__(self, type(self))(*args, **kwargs)
        finally:
            stack.pop()
        outer = [f for f in stack if f[0] is self]
        if outer:  # an override called by another override of this model
            outer[-1][1] = outer[-1][1] or frame[1]
        elif not frame[1]:
            check_ignored(self, defaults)
        return outputs

    train_step._fg_guarded = True
    return train_step


def note_base_step(model):
    """Called by `FastGradModel.train_step`: the options apply."""
    frames = [f for f in getattr(_calls, "stack", ()) if f[0] is model]
    if frames:
        frames[-1][1] = True


def check_ignored(model, defaults):
    """Raises if `model` (whose step did not run `FastGradModel.train_step`)
    has options (not at their `defaults`) or telemetry keys that step alone
    would act on."""
    if getattr(model, "fastgrad_step_state", None) is None:  # not a FastGradModel
        return
    ignored = {
        name: value
        for name, value in model._fg_options().items()
        if value != defaults[name] and _HONOURED.get(name, ...) != value
    }
    keys = [] if "telemetry" in ignored else sorted(model.fastgrad_step_state.log_keys)
    if not ignored and not keys:
        return
    cls = type(model).__name__
    received = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
    if keys:
        received = ", ".join(filter(None, [received, f"telemetry keys {keys}"]))
    callbacks = (
        " (the telemetry keys are those keras_fastgrad's callbacks read: they measure in that step)"
        if keys
        else ""
    )
    raise ValueError(
        f"`{cls}` overrides `train_step` and its step did not call "
        "`FastGradModel.train_step`, which is where these options act: "
        f"they would be silently ignored{callbacks}. Received: {received}. "
        f"Fix: call `super().train_step(data)` from `{cls}.train_step` for "
        "the part the options apply to, or build the model without them "
        "and do it in your own step (e.g. with the optimizers' own "
        "`clipnorm` / `gradient_accumulation_steps`)."
    )
