"""`profile_step`: where a train step's time goes (`measure.py`; the
runs in `_runs.py`, the report in `_report.py`; the command line:
`python -m keras_fastgrad.profiling`)."""

from keras_fastgrad.profiling._runs import MODES, PHASES
from keras_fastgrad.profiling.measure import StepProfile, profile_step

__all__ = ["MODES", "PHASES", "StepProfile", "profile_step"]
