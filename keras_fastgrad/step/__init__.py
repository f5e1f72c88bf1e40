"""The train step, one unit per module, in the order it runs them
(`train_step.py` chains them, starting with `backward.py` and
`verdict.py`; `state.py` holds what they keep, `state_files.py` writes it into files):

    forward (`forward.py`) -> weigh by the loss's normaliser (`weighting.py`;
    micro-batches: `slicing.py`) -> unscale (`loss_scaling.py`) -> finite
    check (`finite.py`) -> accumulate (`accumulation.py`; BatchNorm moments
    pooled over the window: `batchnorm.py`; the noise scale measured:
    `noise_scale.py`) -> adaptive clip (`adaptive_clipping.py`) -> clip
    (`clipping.py`) ->
    apply (`applying.py`, legal under `tf.distribute`: `replicas.py`) ->
    record (`telemetry.py`, `divergence.py`)
"""
