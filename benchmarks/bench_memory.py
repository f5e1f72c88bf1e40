"""Peak memory of in-step micro-batching (issue: speed playbook, part 1).

    python benchmarks/bench_memory.py [--quick]

Each configuration trains a few steps in its own process and reports that
process's peak resident memory (`ru_maxrss`), so configurations cannot share
or free memory for each other. The model's activations dominate: 4096
units wide after the first layer, followed by 12 elementwise layers (few
parameters, 13 x 4096 floats kept per sample), SGD. Ratios:
- FastGradModel(micro_batches=8) at batch 4096 / keras.Model at batch 512:
  target <= 1.25 (one slice of 512 rows lives at a time);
- keras.Model at batch 4096 / keras.Model at batch 512: what the slices save.
Each process is run `reps` times; the ratios are per repetition.
`--quick`: one repetition, the target's two configurations only.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

CONFIGS = {
    "plain_512": ("keras", 512, 1),
    "plain_4096": ("keras", 4096, 1),
    "micro8_4096": ("fastgrad", 4096, 8),
}


def child(name):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_fastgrad

    kind, batch, slices = CONFIGS[name]
    keras.utils.set_random_seed(0)
    # Few parameters, wide activations: every elementwise layer keeps a
    # 4096-wide tensor per sample for the backward pass.
    inputs = keras.Input((64,))
    h = keras.layers.Dense(4096, activation="relu")(inputs)
    for _ in range(12):
        h = keras.layers.Activation("tanh")(h)
    outputs = keras.layers.Dense(10)(h)
    if kind == "keras":
        model = keras.Model(inputs, outputs)
    else:
        model = keras_fastgrad.FastGradModel(inputs, outputs, micro_batches=slices)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 2, 64)).astype("float32")
    y = rng.integers(0, 10, size=(batch * 2,))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak_mb}))


def measure(name):
    out = subprocess.run(
        [sys.executable, __file__, "--child", name],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mb"]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child")
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import WRITTEN, report

    reps = 1 if args.quick else 3
    # Quick: the target's two configurations only (each is a TensorFlow start).
    peaks = {name: [] for name in CONFIGS if not (args.quick and name == "plain_4096")}
    for _ in range(reps):
        for name in peaks:
            peaks[name].append(measure(name))
    for name, values in peaks.items():
        print(f"peak resident memory, {name}: {statistics.median(values):.0f} MB ({values})")

    def ratio(a, b):
        values = [p / q for p, q in zip(peaks[a], peaks[b])]
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "rounds": len(values),
            "kind": "peak memory (not a time)",
        }

    results = {
        "memory: micro_batches=8 @4096 / keras.Model @512": ratio("micro8_4096", "plain_512"),
    }
    if "plain_4096" in peaks:
        results["memory: keras.Model @4096 / keras.Model @512"] = ratio("plain_4096", "plain_512")
    report(
        f"Peak resident memory ratios, one process per configuration ({reps} reps)",
        results,
        {"memory: micro_batches=8 @4096 / keras.Model @512": "<= 1.25"},
        "memory",
    )
    WRITTEN.append(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "memory_peaks.json")
    )
    with open(WRITTEN[-1], "w") as f:
        json.dump(peaks, f, indent=1)


if __name__ == "__main__":
    main()
