"""Multi-task gradient merging: the task losses and the merge in
parameter space (`merger.py`), in representation space (`feature_space.py`,
`representation.py`); the aggregators are `keras_fastgrad.aggregators`."""

from keras_fastgrad.multitask.merger import TaskMerger, task_losses, task_names

__all__ = ["TaskMerger", "task_losses", "task_names"]
