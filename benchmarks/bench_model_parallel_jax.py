"""Issue 49's rows: FastGradModel against keras.Model under `ModelParallel` on JAX.

    python benchmarks/bench_model_parallel_jax.py [--rounds N] [--devices N]

Runs on Keras' JAX backend (the script sets `KERAS_BACKEND=jax` and, on a
machine without several accelerators, `XLA_FLAGS=
--xla_force_host_platform_device_count=8` before JAX loads: its own process
under `run_all.py`, which runs it in the full mode only). Both sides train
the same Transformer encoder (bench_targets' `transformer` shape: vocab
1000, sequence 32, width 64, 2 blocks of 4-head attention + LayerNorm +
FFN 64 -> 256 -> 64, mean-pooled, 10 classes, batch 32, Adam) under the same
`keras.distribution.ModelParallel`: a 2 x (devices / 2) mesh
(`"batch"`, `"model"`), every kernel and the embeddings sharded over
`"model"` by a `LayoutMap` (the 10-class head replicated), the batch
over `"batch"`.

Step time: each side's jitted `train_function` (what Keras' JAX `fit`
calls per batch) called directly, the state threaded through it as `fit`
does, the batches already laid out as the distribution lays them out, each
step timed until its outputs and state are ready; rounds interleaved, order
alternating (`harness.interleaved_step_ratios`: the median ratio, the
spread of the per-round ratios, the ratio of each side's best round).

Memory (deterministic): per device, from XLA's `memory_analysis()` of the
compiled step, jitted as Keras' JAX trainer jits it under a distribution
(`jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, the
state's shardings))`): `peak = temp_size_in_bytes + argument_size_in_bytes
+ output_size_in_bytes - alias_size_in_bytes` (the donated state counted
once), `temp` and `argument` also shown.

Rows (targets from issue 49, each step time and peak memory):
- default (safe) / keras.Model with its update gated on every gradient
  finite (`anchors_jax.JaxGatedModel`)                           <= 1.05;
- `skip_nonfinite=False` / keras.Model                            <= 1.05;
- accumulation 4, `skip_nonfinite=False` / Keras' own
  `gradient_accumulation_steps=4`                                 <= 1.05;
- `clip_norm=1`, `skip_nonfinite=False` / `global_clipnorm=1`     <= 1.05;
- A/A: keras.Model / a second one alike (the method's noise).

Also printed: the window's sums per device against their variables' full
size (read from the arrays' `sharding`), and the accumulation row's peak
memory with the sums replicated instead (each device a whole copy, as
before issue 49: `step.accumulation.sharded_as` patched to `{}` for that
model alone), to show what their layout saves.

Writes benchmarks/out/model_parallel_jax.json.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"  # before Keras loads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _host_devices(argv):
    """`--devices N` (default 8): host devices to make where the machine
    has no several accelerators (read before JAX loads)."""
    count = "8"
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            count = argv[i + 1]
        elif arg.startswith("--devices="):
            count = arg.split("=", 1)[1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


_host_devices(sys.argv[1:])

OWN_PROCESS = True  # the backend and the device count are set when JAX loads

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from anchors_jax import JaxGatedModel  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import jax_state, jax_timed_steps  # noqa: E402

import keras_fastgrad  # noqa: E402

VOCAB, LENGTH, WIDTH, HEADS, CLASSES, BATCH = 1000, 32, 64, 4, 10, 32
UNSAFE = {"skip_nonfinite": False}
SIDES = {  # name: (class, FastGradModel options, Adam options)
    "default": ("fg", {}, {}),
    "unsafe": ("fg", UNSAFE, {}),
    "acc_unsafe": ("fg", {"accumulation_steps": 4, **UNSAFE}, {}),
    "clip_unsafe": ("fg", {"clip_norm": 1.0, **UNSAFE}, {}),
    "keras": ("keras", {}, {}),
    "keras_twin": ("keras", {}, {}),
    "keras_gated": ("gated", {}, {}),
    "keras_acc": ("keras", {}, {"gradient_accumulation_steps": 4}),
    "keras_clip": ("keras", {}, {"global_clipnorm": 1.0}),
}
ROWS = [  # (pair, numerator, denominator, target)
    ("default / keras.Model gated on finite gradients", "default", "keras_gated", "<= 1.05"),
    ("skip_nonfinite=False / keras.Model", "unsafe", "keras", "<= 1.05"),
    (
        "accumulation_steps=4, skip_nonfinite=False / gradient_accumulation_steps=4",
        "acc_unsafe",
        "keras_acc",
        "<= 1.05",
    ),
    (
        "clip_norm=1, skip_nonfinite=False / global_clipnorm=1",
        "clip_unsafe",
        "keras_clip",
        "<= 1.05",
    ),
    ("keras.Model / keras.Model alike (A/A: the noise)", "keras_twin", "keras", None),
]


def transformer(cls, **options):
    """The encoder classifier; the layers named for the `LayoutMap`."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    for i in range(2):
        attended = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, name=f"attention_{i}")(
            h, h
        )
        h = keras.layers.LayerNormalization(name=f"norm_{i}a")(h + attended)
        fed = keras.layers.Dense(4 * WIDTH, activation="relu", name=f"up_{i}")(h)
        fed = keras.layers.Dense(WIDTH, name=f"down_{i}")(fed)
        h = keras.layers.LayerNormalization(name=f"norm_{i}b")(h + fed)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(tokens, keras.layers.Dense(CLASSES, name="head")(h), **options)


def distribution(devices):
    """`ModelParallel` on a 2 x (n / 2) mesh, the kernels over `"model"`
    (the head's 10 classes replicated)."""
    mesh = keras.distribution.DeviceMesh(
        (2, len(devices) // 2), ["batch", "model"], devices=devices
    )
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["embed/embeddings"] = (None, "model")
    layouts["attention_\\d/.*/kernel"] = (None, None, "model")
    layouts["up_\\d/kernel"] = (None, "model")
    layouts["up_\\d/bias"] = ("model",)
    layouts["down_\\d/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


def data(n):
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def build_side(name):
    kind, options, adam = SIDES[name]
    cls = {"fg": keras_fastgrad.FastGradModel, "gated": JaxGatedModel, "keras": keras.Model}[kind]
    model = transformer(cls, **options)
    model.compile(keras.optimizers.Adam(1e-3, **adam), "sparse_categorical_crossentropy")
    return model


def laid_out(dist, array):
    """`array` on the devices as the distribution lays out a batch."""
    return jax.device_put(array, dist.get_data_layout(array.shape).backend_layout)


def memory(model, batch):
    """Per device, from the compiled step's `memory_analysis()` (jitted as
    Keras' JAX trainer jits it under a distribution)."""
    out_shardings = (None, model._get_state_sharding_spec())
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=out_shardings)
    analysis = step.lower(jax_state(model), batch).compile().memory_analysis()
    temp, argument = analysis.temp_size_in_bytes, analysis.argument_size_in_bytes
    peak = temp + argument + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return {"peak": peak, "temp": temp, "argument": argument}


def step_fn(model, batches, steps):
    """A function timing `steps` calls of the model's jitted train
    function on the laid-out `batches` (built and traced by one short
    `fit`); `run(count)`, `run.steps` as `sides.step_fn`'s."""
    x, y = (np.asarray(a) for a in batches[0])
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return jax_timed_steps(model, batches, steps)


def replicated_sums_memory(batches):
    """The accumulation side's `memory`, its sums built replicated."""
    from keras_fastgrad.step import accumulation

    laid_out_as = accumulation.sharded_as
    accumulation.sharded_as = lambda variable: {}
    try:
        model = build_side("acc_unsafe")
        step_fn(model, batches, 0)  # (built, traced)
    finally:
        accumulation.sharded_as = laid_out_as
    return memory(model, batches[0])


def sums_per_device(model):
    """The window's sums: bytes on one device and their variables' full
    bytes (from the arrays' `sharding`)."""
    sums = model.fastgrad_step_state.accumulator.sums
    shard = sum(
        int(np.prod(s.value.sharding.shard_shape(s.shape))) * s.value.dtype.itemsize for s in sums
    )
    full = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    return shard, full


def main(argv=None):
    def extra(parser):
        parser.add_argument("--devices", type=int, default=8, help="host devices (no GPUs)")

    args, rounds, steps, _ = command_line(__doc__, (3, 16), (6, 32), argv=argv, extra=extra)
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "bench_model_parallel_jax.py times Keras' JAX backend, but Keras was imported "
            f"with {keras.backend.backend()!r}. Fix: run it in its own process "
            "(`python benchmarks/bench_model_parallel_jax.py`)."
        )
    devices = jax.devices()
    if len(devices) < 4 or len(devices) % 2:
        raise RuntimeError(
            f"`--devices` must be an even number >= 4. Received: {len(devices)} devices "
            f"({devices[0].platform}). Fix: pass `--devices 8` (host devices), or run on a "
            "machine with an even number of accelerators."
        )
    dist = distribution(devices)
    x, y = data(BATCH * 8)
    with dist.scope():
        batches = [
            (laid_out(dist, x[i : i + BATCH]), laid_out(dist, y[i : i + BATCH]))
            for i in range(0, len(x), BATCH)
        ]
        models = {
            name: build_side(name) for name in dict.fromkeys(r[i] for r in ROWS for i in (1, 2))
        }
        sides = {name: step_fn(model, batches, steps) for name, model in models.items()}
        memories = {name: memory(model, batches[0]) for name, model in models.items()}
        shard, full = sums_per_device(models["acc_unsafe"])
        replicated = replicated_sums_memory(batches)
    label = f"ModelParallel 2x{len(devices) // 2} ({devices[0].platform})"
    pairs = [(f"{label}: {pair}", sides[a], sides[b]) for pair, a, b, _ in ROWS]
    results = interleaved_step_ratios(pairs, rounds)
    targets = {f"{label}: {pair}": t for pair, _, _, t in ROWS if t}
    memory_rows = {}
    for pair, a, b, target in ROWS:
        row = {k: memories[a][k] / memories[b][k] for k in ("peak", "temp", "argument")}
        row["bytes"] = [memories[a], memories[b]]
        memory_rows[f"{label}: {pair}"] = row
    report(
        f"Issue 49's rows: ModelParallel on Keras' JAX backend (jax {jax.__version__}, "
        f"{len(devices)} {devices[0].platform} devices, step-level, {rounds} rounds of {steps} steps)",
        results,
        targets,
        "model_parallel_jax",
        entries={
            "memory": memory_rows,
            "sums_bytes_per_device": shard,
            "variables_bytes": full,
            "acc_replicated_sums_memory": replicated,
        },
    )
    print("\nPeak memory per device (memory_analysis: temp + argument + output - alias), ratios")
    print(f"{'pair':84s} {'peak':>7s} {'temp':>7s} {'argument':>9s}  bytes (peak)")
    for name, row in memory_rows.items():
        a, b = (side["peak"] for side in row["bytes"])
        print(f"{name:84s} {row['peak']:7.3f} {row['temp']:7.3f} {row['argument']:9.3f}  {a} / {b}")
    print(
        f"\nThe window's sums (accumulation_steps=4): {shard} bytes per device; their "
        f"variables {full} bytes in all ({shard / full:.3f} of them)"
    )
    acc = memories["acc_unsafe"]["peak"], memories["keras_acc"]["peak"]
    print(
        f"Replicated instead: the accumulation row's peak {replicated['peak']} bytes, "
        f"{replicated['peak'] / acc[1]:.3f} of Keras' (sharded: {acc[0]}, {acc[0] / acc[1]:.3f})\n"
    )


if __name__ == "__main__":
    main()
