"""The train step's own memory, read from each backend's figures (issue 48).

    python benchmarks/bench_step_memory.py [--models conv,mlp] [--configs a,b]
                                           [--threads default,8] [--reps N] [--mixed]
    KERAS_BACKEND=jax python benchmarks/bench_step_memory.py [...]

Each configuration is built in a fresh process (one per repetition) and
measured there:
- TensorFlow: the CPU allocator's peak. `reset_memory_stats("CPU:0")`
  after a warm-up `fit` (the step traced, the optimizer built), then
  `get_memory_info("CPU:0")` around 3 steps of the compiled
  `train_function` on one batch already in memory: `peak` is the step's
  peak, `current` at the reset what lives between steps (parameters,
  optimizer state, the batch); `peak - current` is the step's working
  memory beyond them. TensorFlow's CPU allocator counts tensors of
  256 KiB and up only (smaller ones come from a pool it does not report),
  so every figure is that granularity's.
  `--threads 8`: `tf.config.threading.set_inter_op_parallelism_threads(8)`
  before anything runs (`default`: TensorFlow's own count).
- JAX: XLA's `memory_analysis()` of the jitted train step (`jax.jit` of
  the model's `train_step`, the state donated, as Keras' trainer jits it):
  `temp` (`temp_size_in_bytes`) is the step's working memory beyond its
  arguments (parameters, optimizer state, the batch) and outputs; `peak`
  is `temp + arguments + outputs - aliased` (donated buffers counted
  once). A compile-time figure: the repetitions agree.

Models (`--models`): `conv` (activations dominate: 64x64x3 images,
Conv2D 16 -> Conv2D 16 -> max-pool -> Conv2D 32 -> global average ->
Dense 10, 7.7k parameters, batch 128: 256 was too slow to repeat on the 2
shared cores this was written on), `mlp` (parameters dominate:
512 -> 4096 -> 4096 -> 512 -> 10, 21.0M parameters, batch 16). Adam,
sparse categorical cross-entropy, float32.

Configurations (`--configs`) and what each is compared with:
- `keras`: `keras.Model` (the anchor);
- `keras_gated`: `keras.Model` whose update runs only when every gradient
  is finite (`anchors.GatedModel`, `anchors_jax.JaxGatedModel`); `/ keras`;
- `default`: `FastGradModel()`; `/ keras_gated` (the same gate);
- `unsafe`: `FastGradModel(skip_nonfinite=False)`; `/ keras`;
- `keras_acc4`: `keras.Model`, `Adam(gradient_accumulation_steps=4)`;
- `acc4`: `FastGradModel(accumulation_steps=4)`; `/ keras_acc4`;
- `micro2`, `micro4`, `micro8`: `FastGradModel(micro_batches=m)`;
  `/ keras_gated` (peak), and their working memory `/ default`'s (the
  un-split step; target <= 1.15/m).
`--mixed`: every configuration under the `mixed_float16` policy (Keras'
side with the `LossScaleOptimizer` that `compile` wraps it in; the
library's sums and window stay float32).
Each row prints medians over the repetitions of the peak, the working
memory and, on `mlp`, `(peak - anchor's peak) / gradient size`: how many
gradient-sized buffers more than the anchor.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {"conv": ((64, 64, 3), 128), "mlp": ((512,), 16)}

# name: (side, model options, optimizer options, anchor)
CONFIGS = {
    "keras": ("keras", {}, {}, None),
    "keras_gated": ("gated", {}, {}, "keras"),
    "default": ("fg", {}, {}, "keras_gated"),
    "unsafe": ("fg", {"skip_nonfinite": False}, {}, "keras"),
    "keras_acc4": ("keras", {}, {"gradient_accumulation_steps": 4}, None),
    "acc4": ("fg", {"accumulation_steps": 4}, {}, "keras_acc4"),
    "micro2": ("fg", {"micro_batches": 2}, {}, "keras_gated"),
    "micro4": ("fg", {"micro_batches": 4}, {}, "keras_gated"),
    "micro8": ("fg", {"micro_batches": 8}, {}, "keras_gated"),
}
THREADS = ("default", "8")
POLICY_VARIABLE = "BENCH_STEP_MEMORY_POLICY"  # (`--mixed`, read by each process)
STEPS = 3
MB = 1024 * 1024


def build(name, cls):
    import keras

    keras.utils.set_random_seed(0)
    shape, _ = MODELS[name]
    inputs = keras.Input(shape)
    if name == "conv":
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
    else:
        h = keras.layers.Dense(4096, activation="relu")(inputs)
        h = keras.layers.Dense(4096, activation="relu")(h)
        h = keras.layers.Dense(512, activation="relu")(h)
    return cls(inputs, keras.layers.Dense(10)(h))


def compiled_model(model_name, config, backend):
    import keras

    side, model_options, optimizer_options, _ = CONFIGS[config]
    if side == "fg":
        import keras_fastgrad

        cls = lambda i, o: keras_fastgrad.FastGradModel(i, o, **model_options)  # noqa: E731
    elif side == "gated" and backend == "jax":
        from anchors_jax import JaxGatedModel as cls
    elif side == "gated":
        from anchors import GatedModel as cls
    else:
        cls = keras.Model
    model = build(model_name, cls)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4, **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def child(model_name, config, threads):
    """One measurement, printed as a JSON line (bytes)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, HERE)
    import keras

    backend = keras.backend.backend()
    policy = os.environ.get(POLICY_VARIABLE)
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    if backend == "tensorflow":
        import tensorflow as tf

        if threads != "default":  # before anything runs
            tf.config.threading.set_inter_op_parallelism_threads(int(threads))
    import numpy as np

    shape, batch = MODELS[model_name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    model = compiled_model(model_name, config, backend)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # traced, built
    gradient_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    if backend == "jax":
        import jax

        sys.path.insert(0, HERE)
        from sides import jax_state

        data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
        step = jax.jit(model.train_step, donate_argnums=0)
        analysis = step.lower(jax_state(model), data).compile().memory_analysis()
        temp = analysis.temp_size_in_bytes
        peak = (
            temp
            + analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        figures = {"peak": peak, "working": temp}
    else:
        import tensorflow as tf

        iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        function = model.train_function
        function(iterator)
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        for _ in range(STEPS):
            float(function(iterator)["loss"])  # (waits for the step's end)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        figures = {"peak": peak, "working": peak - before}
    figures["gradient"] = gradient_bytes
    print(json.dumps(figures))


def measure(model_name, config, threads, policy=""):
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", model_name, config, threads],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **{POLICY_VARIABLE: policy}),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def names(value, known, option):
    """`value` (comma-separated) as a list of `known` names; refuses others."""
    chosen = [v for v in value.split(",") if v]
    unknown = [v for v in chosen if v not in known]
    if unknown or not chosen:
        raise ValueError(
            f"`{option}` takes names from {', '.join(known)}. Received: {option}={value}"
        )
    return chosen


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--threads", default=",".join(THREADS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    args.models = names(args.models, MODELS, "--models")
    args.configs = names(args.configs, CONFIGS, "--configs")
    args.threads = names(args.threads, THREADS, "--threads")
    if args.reps < 1:
        raise ValueError(f"`--reps` must be an integer >= 1. Received: --reps={args.reps}")
    return args


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def rows(results, model_name, threads):
    """The report's lines for one model and thread setting."""
    got = {c: runs for (m, c, t), runs in results.items() if m == model_name and t == threads}
    lines = []
    gradient = next(iter(got.values()))[0]["gradient"]
    for config, runs in got.items():
        peak, working = median_of(runs, "peak"), median_of(runs, "working")
        anchor = CONFIGS[config][3]
        line = f"  {config:<12} peak {peak / MB:8.1f} MB  working {working / MB:8.1f} MB"
        if anchor in got:
            anchor_peak = median_of(got[anchor], "peak")
            anchor_working = median_of(got[anchor], "working")
            line += f"  / {anchor}: peak {peak / anchor_peak:.2f}"
            line += f", working {working / max(anchor_working, 1):.2f}"
            if gradient >= MB:  # (a few kB on `conv`: no buffer to count)
                line += f", {(peak - anchor_peak) / gradient:+.2f} gradients"
        if config.startswith("micro") and "default" in got:
            m = int(config[len("micro") :])
            unsplit = median_of(got["default"], "working")
            line += f"  working / default's {working / max(unsplit, 1):.2f}"
            if model_name == "conv":  # (the MLP's working memory is its gradients')
                line += f" (target <= {1.15 / m:.2f})"
        spread = [round(r["working"] / MB, 1) for r in runs]
        lines.append(f"{line}  [working MB each run: {spread}]")
    return [f"{model_name}, gradient {gradient / MB:.1f} MB, threads {threads}:"] + lines


def main(argv=None):
    args = parse(argv)
    if args.child:
        return child(*args.child)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    threads = args.threads if backend == "tensorflow" else ["default"]
    results = {}
    for model_name in args.models:
        for t in threads:
            for _ in range(args.reps):  # repetitions interleaved over the configurations
                for config in args.configs:
                    results.setdefault((model_name, config, t), []).append(
                        measure(model_name, config, t, "mixed_float16" if args.mixed else "")
                    )
    what = "XLA memory_analysis()" if backend == "jax" else "allocator peak, tensors >= 256 KiB"
    policy = ", mixed_float16" if args.mixed else ""
    print(f"Step memory on {backend}{policy} ({what}), medians of {args.reps} processes each")
    for model_name in args.models:
        for t in threads:
            print("\n".join(rows(results, model_name, t)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"|".join(k): v for k, v in results.items()}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
