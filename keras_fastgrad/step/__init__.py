"""The step's backend-neutral core: every decision of the train step,
written once for both backends (`keras.ops`, typed records, no TensorFlow,
no JAX). The shells (`keras_fastgrad.backend.tensorflow`,
`keras_fastgrad.backend.jax`) run the step and call these rules:

    weigh each micro-batch (`weighting.py`; micro-batches: `splitting.py`,
    `slicing.py`) -> keep or drop it (`verdict.py`; the streak and the stop:
    `divergence.py`) -> the loss scale (`loss_scaling.py`) -> the window
    (`accumulation.py`; BatchNorm moments pooled over it: `batchnorm.py`;
    the noise scale: `noise_scale.py`) -> adaptive clip
    (`adaptive_clipping.py`) -> the update's check (`verdict.py`) -> record
    (`telemetry.py`); several tasks merged: `multitask.py`.

`state.py` holds what the units keep between steps (`options.py`: the
options as they read them), `state_files.py` writes it into files. The
options' checks and refusals, before anything is traced:
`option_checks.py` (each value, and how they combine) and
`compile_checks.py` (against the compiled optimizer and losses).
"""
