"""One of the two JAX processes of tests/end_to_end/test_multiprocess_jax.py.

`python -m tests.multiprocess_jax_worker PROCESS_ID PORT OUT_DIR`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=2` (2 host devices a
process, 4 in all): JAX's CPU collectives (gloo), the coordinator on
127.0.0.1:PORT, `keras.distribution.initialize`. Each case trains a
`FastGradModel` under `DataParallel` or `ModelParallel` over the 4 devices
and writes its weights (`CASE.pPROCESS_ID.npz`) and counters
(`pPROCESS_ID.json`) to OUT_DIR; the test compares them with a plain
`keras.Model` trained on the same rows in one process. `resume`: process 0
saves `mid.keras` mid-window; both processes load it and finish the window.

Keras' JAX trainer makes each step's global batch of the processes' local
batches (`jax.make_array_from_process_local_data`, process 0's rows first):
a process feeds its half of each global batch of 16 (`local_rows`), and the
distributions leave the data unsharded (`auto_shard_dataset=False`: Keras
shards only `tf.data`).

No `jax` import at the top: the test imports the data and models from here.
"""

import json
import os
import sys

import numpy as np

CLIP = 0.05
BATCH = 16  # a global batch: 8 rows from each process
PROCESSES = 2

# Each case: the model, its data's rows, the FastGradModel options, the
# epochs, the global row given a NaN (`None`: none), the distribution.
CASES = {
    # windows [16, 16 with a NaN in process 1's rows, 16] and the epoch's
    # partial window [8], twice
    "data_parallel_mlp": (
        "mlp",
        56,
        {"accumulation_steps": 3, "clip_norm": CLIP},
        2,
        26,
        "data",
    ),
    # windows [16, 16] of 2 micro-batches each, then the partial window [16]
    "data_parallel_attention": (
        "attention",
        48,
        {"accumulation_steps": 2, "micro_batches": 2, "clip_norm": CLIP},
        1,
        None,
        "data",
    ),
    # the kernels sharded over the "model" axis; a NaN in process 0's rows
    "model_parallel_mlp": (
        "mlp",
        48,
        {"accumulation_steps": 2, "clip_norm": CLIP},
        1,
        18,
        "model",
    ),
}
RESUME_ROWS = 64  # `resume`: a window of 4 batches of 16, saved after 2


def local_rows(rows, process_id):
    """The rows (indices) that process `process_id` feeds, in order: its
    share of each global batch of `BATCH` rows."""
    picked = []
    for start in range(0, rows, BATCH):
        share = (min(start + BATCH, rows) - start) // PROCESSES
        picked.extend(range(start + process_id * share, start + (process_id + 1) * share))
    return np.array(picked)


def data(kind, rows):
    """`(x, y)`: `rows` rows for the model `kind`."""
    rng = np.random.default_rng(0)
    if kind == "mlp":
        x = rng.normal(size=(rows, 8)).astype("float32")
        return x, rng.normal(size=(rows, 3)).astype("float32")
    x = rng.integers(0, 20, size=(rows, 6)).astype("int32")
    return x, rng.integers(0, 3, size=(rows,)).astype("int32")


def build(kind, cls, **options):
    """The model `kind` ("mlp": 8-16-3; "attention": Embedding, self-attention,
    LayerNormalization, pooling, Dense) as `cls`, with the same weights each
    call; compiled (Adam, no clipping of its own)."""
    import keras

    if kind == "mlp":
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
        loss = "mse"
    else:
        inputs = keras.Input((6,), dtype="int32")
        e = keras.layers.Embedding(20, 8, name="embed")(inputs)
        a = keras.layers.MultiHeadAttention(2, 4, name="attend")(e, e)
        h = keras.layers.LayerNormalization(name="norm")(e + a)
        h = keras.layers.GlobalAveragePooling1D()(h)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = cls(inputs, keras.layers.Dense(3, name="out")(h), **options)
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(scale=0.3, size=w.shape) for w in model.weights])
    model.compile(keras.optimizers.Adam(1e-2), loss)
    return model


def _distribution(kind, keras, jax):
    if kind == "data":
        return keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["hidden/kernel"] = (None, "model")
    layouts["hidden/bias"] = ("model",)
    layouts["out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(
        layout_map=layouts, batch_dim_name="batch", auto_shard_dataset=False
    )


def _save(out, name, process_id, model):
    np.savez(os.path.join(out, f"{name}.p{process_id}.npz"), *model.get_weights())


def main(process_id, port, out):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=process_id
    )
    from jax.experimental import multihost_utils

    import keras_fastgrad as kf

    assert (jax.process_count(), len(jax.devices()), jax.local_device_count()) == (2, 4, 2)
    report = {}
    for name, (kind, rows, options, epochs, nan_row, parallel) in CASES.items():
        x, y = data(kind, rows)
        if nan_row is not None:
            x[nan_row, 0] = np.nan
        mine = local_rows(rows, process_id)
        with _distribution(parallel, keras, jax).scope():
            model = build(kind, kf.FastGradModel, **options)
            model.fit(
                x[mine],
                y[mine],
                batch_size=BATCH // PROCESSES,
                epochs=epochs,
                shuffle=False,
                verbose=0,
            )
        _save(out, name, process_id, model)
        layer = model.get_layer("hidden" if kind == "mlp" else "out")
        at = [i for i, v in enumerate(model.trainable_variables) if v is layer.kernel][0]
        window_sum = model.fastgrad_step_state.accumulator.sums[at].value
        report[name] = {
            "counters": model.telemetry_counters(),
            "kernel_spec": str(tuple(layer.kernel.value.sharding.spec)),
            "kernel_devices": len(layer.kernel.value.sharding.device_set),
            "window_sum_spec": str(tuple(window_sum.sharding.spec)),
        }

    # Mid-window: 2 of the window's 4 batches, saved by process 0 alone.
    x, y = data("mlp", RESUME_ROWS)
    batches = [local_rows(BATCH, process_id) + start for start in range(0, RESUME_ROWS, BATCH)]
    distribution = _distribution("data", keras, jax)
    with distribution.scope():
        model = build("mlp", kf.FastGradModel, accumulation_steps=4, clip_norm=CLIP)
        for rows in batches[:2]:
            model.train_on_batch(x[rows], y[rows])
    path = os.path.join(out, "mid.keras")
    if process_id == 0:  # outside the scope: Keras' saving makes an optimizer,
        model.save(path)  # whose variables the scope would place on both processes
    multihost_utils.sync_global_devices("mid.keras saved")
    with distribution.scope():
        loaded = keras.saving.load_model(path)
        pending = int(loaded.fastgrad_step_state.accumulator.micro_step.numpy())
        for rows in batches[2:]:
            loaded.train_on_batch(x[rows], y[rows])
            model.train_on_batch(x[rows], y[rows])
    _save(out, "resumed", process_id, loaded)
    _save(out, "uninterrupted", process_id, model)
    report["resume"] = {"pending": pending, "counters": loaded.telemetry_counters()}
    with open(os.path.join(out, f"p{process_id}.json"), "w") as f:
        json.dump(report, f)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
