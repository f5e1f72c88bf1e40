"""Keras callbacks that read what the compiled FastGradModel step measured.

Each asks the model's step for the telemetry it needs when attached (so the
step is traced with it) and reports on the host, through fixed log keys:

- `GradientNormLogger`: `grad_norm`, optionally `grad_norm/<layer>`,
  `clipped_fraction`, `update_ratio`; optionally TensorBoard scalars and
  weight histograms.
- `NonFiniteGuard`: raises `NonFiniteError`, stops or warns on NaN/Inf,
  naming the variable.
- `TapeVariableCounter`: `tape_variables`, `trainable_variables`.
- `RetraceWatch`: `train_traces`, and a warning with cause and fix.
- `GradientNoiseScale`: `gns_simple` (the critical batch size `B_simple`),
  `gns_grad_sq`, `gns_trace`; printed in words, optionally TensorBoard.

Values a callback adds to the logs reach only the callbacks listed after it:
list these before `CSVLogger` or `keras.callbacks.TensorBoard`.
"""

from keras_fastgrad.callbacks._base import FastGradCallback
from keras_fastgrad.callbacks.gradient_noise_scale import GradientNoiseScale
from keras_fastgrad.callbacks.gradient_norm_logger import GradientNormLogger
from keras_fastgrad.callbacks.non_finite_guard import NonFiniteError, NonFiniteGuard
from keras_fastgrad.callbacks.retrace_watch import RetraceWatch
from keras_fastgrad.callbacks.tape_variable_counter import TapeVariableCounter

__all__ = [
    "FastGradCallback",
    "GradientNoiseScale",
    "GradientNormLogger",
    "NonFiniteError",
    "NonFiniteGuard",
    "RetraceWatch",
    "TapeVariableCounter",
]
