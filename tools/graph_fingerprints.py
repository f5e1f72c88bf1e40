"""The traced step of many `FastGradModel` configurations, fingerprinted:
does a refactor leave the graphs as they were?

    python tools/graph_fingerprints.py OUT.json [--compare BEFORE.json] [--only a,b]
    KERAS_BACKEND=jax python tools/graph_fingerprints.py OUT.json ...

On TensorFlow each configuration's fingerprint is the count of each op
type in its traced `train_step` (the function graphs of its `cond`s and
loops included); on JAX, the number of StableHLO ops of its lowered
`train_step` and the SHA-1 of that text (lowering is deterministic).
`benchmarks/bench_graph.py` and `bench_jax_graph.py` count a few rows
against `keras.Model`; this covers what they do not (micro_batches with
regularisers and `"sum"`, multi-task merging in both spaces, ungated and
accumulating variants, a `compute_metrics` or `compute_loss_and_updates`
override, BatchNorm window statistics, loss scaling, mixed precision on
TensorFlow). With `--compare`, prints each configuration whose
fingerprint differs (the op types that changed) and exits with status 1
if any does: run it on the tree before a change, then after.
"""

import argparse
import collections
import hashlib
import json
import os
import pathlib
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (this checkout's keras_fastgrad, not an installed one)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fastgrad  # noqa: E402

FG = keras_fastgrad.FastGradModel
ROWS = 16
JAX = keras.backend.backend() == "jax"


class MetricsOverride(FG):
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class OwnLoss(FG):
    def compute_loss_and_updates(self, *args, **kwargs):
        loss, aux = super().compute_loss_and_updates(*args, **kwargs)
        return loss * 1.0, aux


def model(cls=FG, heads=1, reg=False, bn=False, **options):
    """An MLP (8 -> 16 -> 16 -> 4 logits per head), the same weights each call."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = inputs
    kw = {"kernel_regularizer": keras.regularizers.L2(1e-3)} if reg else {}
    for _ in range(2):
        h = keras.layers.Dense(16, activation="relu", **kw)(h)
    if bn:
        h = keras.layers.BatchNormalization()(h)
    if heads == 1:
        return cls(inputs, keras.layers.Dense(4)(h), **options)
    outputs = {f"t{i}": keras.layers.Dense(4, name=f"t{i}")(h) for i in range(heads)}
    return cls(inputs, outputs, **options)


def gns_keys():
    return keras_fastgrad.callbacks.GradientNoiseScale.telemetry_keys


# name: (model's arguments, compile's, telemetry keys or None, backends)
BOTH, TF_ONLY = ("tensorflow", "jax"), ("tensorflow",)
CONFIGS = {
    "default": ({}, {}, None, BOTH),
    "metrics": ({}, {"metrics": ["accuracy"]}, None, BOTH),
    "ungated": ({"skip_nonfinite": False}, {}, None, BOTH),
    "ungated_counted": ({"skip_nonfinite": False}, {}, ["nonfinite_count"], BOTH),
    "ungated_acc2": ({"skip_nonfinite": False, "accumulation_steps": 2}, {}, None, BOTH),
    "override_metrics": ({"cls": MetricsOverride}, {"metrics": ["accuracy"]}, None, BOTH),
    "override_metrics_acc2": (
        {"cls": MetricsOverride, "accumulation_steps": 2},
        {"metrics": ["accuracy"]},
        None,
        BOTH,
    ),
    "acc2_where": ({"accumulation_steps": 2}, {}, ["nonfinite_first_index"], BOTH),
    "acc2_reg": ({"reg": True, "accumulation_steps": 2}, {}, None, BOTH),
    "clip": ({"clip_norm": 1.0}, {}, None, BOTH),
    "clip_acc2": ({"clip_norm": 1.0, "accumulation_steps": 2}, {}, None, BOTH),
    "clip_telemetry": ({"clip_norm": 1.0, "telemetry": True}, {}, None, BOTH),
    "agc_acc2": ({"clip_adaptive": 0.01, "accumulation_steps": 2}, {}, None, BOTH),
    "agc_lso": ({"clip_adaptive": 0.01, "telemetry": True}, {"lso": True}, None, BOTH),
    "acc4_clip_telemetry_lso": (
        {"accumulation_steps": 4, "clip_norm": 1.0, "telemetry": True},
        {"lso": True},
        None,
        BOTH,
    ),
    "bn_window_acc2": ({"bn": True, "accumulation_steps": 2}, {}, None, BOTH),
    "mb2": ({"micro_batches": 2}, {}, None, BOTH),
    "mb2_lso": ({"micro_batches": 2}, {"lso": True}, None, BOTH),
    "mb2_reg": ({"reg": True, "micro_batches": 2}, {}, None, BOTH),
    "mb2_reg_sum": ({"reg": True, "micro_batches": 2}, {"reduction": "sum"}, None, BOTH),
    "mb2_acc2_bn": ({"bn": True, "micro_batches": 2, "accumulation_steps": 2}, {}, None, BOTH),
    "mb2_acc2_gns": ({"micro_batches": 2, "accumulation_steps": 2}, {}, "gns", BOTH),
    "own_loss": ({"cls": OwnLoss}, {"lso": True}, None, BOTH),
    "own_loss_mb2_acc2": (
        {"cls": OwnLoss, "micro_batches": 2, "accumulation_steps": 2},
        {},
        None,
        BOTH,
    ),
    "pcgrad": ({"heads": 2, "multitask": "pcgrad"}, {}, None, BOTH),
    "pcgrad_reg": ({"heads": 2, "reg": True, "multitask": "pcgrad"}, {}, None, BOTH),
    "pcgrad_acc2": ({"heads": 2, "multitask": "pcgrad", "accumulation_steps": 2}, {}, None, BOTH),
    "mgda_lso_telemetry": (
        {"heads": 2, "multitask": "mgda", "telemetry": True},
        {"lso": True},
        None,
        BOTH,
    ),
    "pcgrad_mb2_reg": (
        {"heads": 2, "reg": True, "multitask": "pcgrad", "micro_batches": 2},
        {},
        None,
        BOTH,
    ),
    "pcgrad_features_acc2": (
        {"heads": 2, "multitask": "pcgrad", "multitask_space": "features", "accumulation_steps": 2},
        {},
        None,
        BOTH,
    ),
    # XLA's CPU dot refuses float16 in / float32 out: mixed precision on TensorFlow only
    "mixed_default": ({}, {"mixed": True}, None, TF_ONLY),
    "mixed_acc2": ({"accumulation_steps": 2}, {"mixed": True}, None, TF_ONLY),
    "mixed_mb2": ({"micro_batches": 2}, {"mixed": True}, None, TF_ONLY),
    "mixed_pcgrad": ({"heads": 2, "multitask": "pcgrad"}, {"mixed": True}, None, TF_ONLY),
}


def fingerprint(name):
    """The configuration `name`'s fingerprint (a dict)."""
    options, compile_options, keys, _ = CONFIGS[name]
    compile_options = dict(compile_options)
    mixed = compile_options.pop("mixed", False)
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        built = model(**options)
        return _traced(built, options.get("heads", 1), compile_options, keys)
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()


def _traced(built, heads, compile_options, keys):
    if keys:
        built.enable_telemetry(gns_keys() if keys == "gns" else keys)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=compile_options.get("reduction", "sum_over_batch_size")
    )
    names = [f"t{i}" for i in range(heads)]
    optimizer = keras.optimizers.Adam()
    if compile_options.get("lso") or keras.mixed_precision.global_policy().name == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    metrics = compile_options.get("metrics")
    built.compile(
        optimizer=optimizer,
        loss=loss if heads == 1 else dict.fromkeys(names, loss),
        metrics=metrics if heads == 1 or metrics is None else dict.fromkeys(names, metrics),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    label = rng.integers(0, 4, size=(ROWS,))
    y = label if heads == 1 else dict.fromkeys(names, label)
    built.fit(x, y, batch_size=ROWS, epochs=1, verbose=0)
    return _jax_fingerprint(built, x, y) if JAX else _tf_fingerprint(built, x, y)


def _tf_fingerprint(built, x, y):
    import tensorflow as tf

    spec = keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, tf.as_dtype(t.dtype)), (x, y))
    graph = tf.function(built.train_step).get_concrete_function(spec).graph
    counts, seen = collections.Counter(), set()

    def walk(g):
        counts.update(op.type for op in g.get_operations())
        for name, function in getattr(g, "_functions", {}).items():  # (cond / loop bodies)
            if name not in seen:
                seen.add(name)
                walk(function.graph)

    walk(graph)
    return {"ops": sum(counts.values()), "by_type": dict(sorted(counts.items()))}


_STABLEHLO_OP = re.compile(r"\b(?:stablehlo|chlo)\.[a-z_]+|\bcall @")


def _jax_fingerprint(built, x, y):
    import jax

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))
    from sides import jax_state  # noqa: E402

    text = jax.jit(built.train_step).lower(jax_state(built), (x, y)).as_text()
    ops = sum(len(_STABLEHLO_OP.findall(line)) for line in text.splitlines())
    return {"ops": ops, "sha1": hashlib.sha1(text.encode()).hexdigest()}


def differences(before, after):
    """`{name: description}` of the configurations whose fingerprints differ."""
    found = {}
    for name in sorted(set(before) & set(after)):
        old, new = before[name], after[name]
        if old == new:
            continue
        if "by_type" in old and "by_type" in new:
            types = set(old["by_type"]) | set(new["by_type"])
            changed = {
                t: new["by_type"].get(t, 0) - old["by_type"].get(t, 0)
                for t in sorted(types)
                if old["by_type"].get(t, 0) != new["by_type"].get(t, 0)
            }
            found[name] = f"{old['ops']} -> {new['ops']} ops: {changed}"
        else:
            found[name] = f"{old.get('ops')} -> {new.get('ops')} ops, the text differs"
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where to write the fingerprints (JSON)")
    parser.add_argument("--compare", help="fingerprints written before (JSON)")
    parser.add_argument("--only", help=f"comma-separated, of {list(CONFIGS)}")
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    names = [n for n, c in CONFIGS.items() if backend in c[3]]
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(names))
        if unknown:
            parser.error(f"`--only` must name configurations of {names}. Received: {unknown}.")
        names = [n for n in names if n in args.only.split(",")]
    result = {}
    for name in names:
        result[name] = fingerprint(name)
        print(f"{name:28s} {result[name]['ops']:6d}", flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"backend": backend, **result}, indent=1))
    if args.compare:
        before = json.loads(pathlib.Path(args.compare).read_text())
        if before.pop("backend", backend) != backend:
            parser.error(f"`--compare` holds another backend's fingerprints ({args.compare}).")
        changed = differences(before, result)
        for name, text in changed.items():
            print(f"changed: {name}: {text}")
        print(f"{len(changed)} of {len(set(before) & set(result))} configurations changed")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
