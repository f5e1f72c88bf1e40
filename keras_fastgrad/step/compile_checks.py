"""`FastGradModel`'s options against the compiled model, checked once in
Python when it is compiled (or given the step by `fastgrad`): a concern
its optimizer owns too (accumulation, clipping), a multi-task method
without two task losses. The options' own values are
`keras_fastgrad.step.option_checks`'.
"""

from keras_fastgrad import aggregators
from keras_fastgrad.step.task_losses import check_task_count


def check_compiled(model, options):
    """Refuses `options` (`FastGradModel`'s, checked) that do not fit the
    compiled `model`: a concern its optimizer owns too, a multi-task
    method without two task losses. Reads the model only, so `fastgrad`
    refuses before it changes anything."""
    check_optimizer_ownership(model.optimizer, options["accumulation_steps"], options["clip_norm"])
    if options["multitask"] is not None:
        check_task_count(model, aggregators.get(options["multitask"]))


def check_optimizer_ownership(optimizer, accumulation_steps, clip_norm):
    """Refuses a concern owned twice: by the model and by the optimizer.

    Args:
        optimizer: The compiled optimizer (possibly a `LossScaleOptimizer`).
        accumulation_steps: The model's `accumulation_steps`.
        clip_norm: The model's `clip_norm`.

    Raises:
        ValueError: if the optimizer accumulates while the model does, or
            clips while the model does.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    optimizer_steps = getattr(inner, "gradient_accumulation_steps", None)
    if accumulation_steps > 1 and optimizer_steps:
        raise ValueError(
            "Gradient accumulation is set twice: "
            f"`FastGradModel(accumulation_steps={accumulation_steps})` and "
            f"the optimizer's `gradient_accumulation_steps={optimizer_steps}`. "
            "Only one may own it. Fix: remove `gradient_accumulation_steps` "
            "from the optimizer (the model's accumulation is exact for "
            "uneven batches and sample weights), or use "
            "`accumulation_steps=1`."
        )
    if clip_norm is not None:
        for attr in ("clipnorm", "global_clipnorm", "clipvalue"):
            optimizer_value = getattr(inner, attr, None)
            if optimizer_value is not None:
                raise ValueError(
                    "Gradient clipping is set twice: "
                    f"`FastGradModel(clip_norm={clip_norm})` and the "
                    f"optimizer's `{attr}={optimizer_value}`. Only one may "
                    f"own it. Fix: remove `{attr}` from the optimizer (the "
                    "model clips the final gradient of each update once, "
                    "after accumulation), or use `clip_norm=None`."
                )
