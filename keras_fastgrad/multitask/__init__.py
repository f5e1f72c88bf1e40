"""Multi-task gradient merging: the merge in parameter space (`merger.py`),
in representation space (`feature_space.py`, `representation.py`); the task
losses are the step's (`keras_fastgrad.step.task_losses`), the aggregators
are `keras_fastgrad.aggregators`."""

from keras_fastgrad.multitask.merger import TaskMerger
from keras_fastgrad.step.task_losses import task_losses, task_names

__all__ = ["TaskMerger", "task_losses", "task_names"]
