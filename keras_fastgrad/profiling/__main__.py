"""Profile a train step from the command line.

    python -m keras_fastgrad.profile [--model PATH.keras] [--batch-size N]
        [--modes eager,function,xla,mixed_float16,mixed_bfloat16]
        [--repeats N] [--warmup N] [--quick] [--png PATH]

Without `--model` it profiles a small built-in model: a `FastGradModel`
MLP (64 -> 3 x Dense 256 relu -> 10, Adam, sparse categorical
cross-entropy) fed by a `tf.data` pipeline of synthetic batches of 128, so
the input pipeline is timed too (on JAX: one synthetic batch of 128). With `--model` it loads a compiled
`.keras` model and profiles it on a synthetic batch shaped like its
inputs (targets shaped like its outputs, or integer labels for sparse
losses). Prints the table and the recommendations of
`keras_fastgrad.profile_step`; `--png` also saves the bar chart.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import tree  # noqa: E402

from keras_fastgrad.models.model import FastGradModel  # noqa: E402
from keras_fastgrad.profiling.measure import MODES, profile_step  # noqa: E402

BUILTIN_BATCH = 128


def builtin_model():
    """The built-in model, compiled."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,), name="features")
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(256, activation="relu", name=f"dense_{i}")(h)
    model = FastGradModel(inputs, keras.layers.Dense(10, name="logits")(h), name="builtin_mlp")
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def builtin_data(batch_size=BUILTIN_BATCH, batches=8):
    """Synthetic batches for the built-in model: on TensorFlow a
    `tf.data.Dataset` (its input pipeline is timed too); on JAX, where
    TensorFlow need not be installed, one batch of numpy arrays."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size * batches, 64)).astype("float32")
    y = rng.integers(0, 10, size=(batch_size * batches,)).astype("int32")
    if keras.backend.backend() != "tensorflow":
        return x[:batch_size], y[:batch_size]
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).prefetch(2)


def synthetic_batch(model, batch_size, seed=0):
    """A batch `(x, y)` that fits `model`: inputs drawn from a normal
    distribution, targets shaped like the outputs (floats in [0, 1)), or
    integer labels when the loss wants those (sparse losses).

    Raises:
        ValueError: if the model has no symbolic inputs (a subclassed model)
            or input dimensions other than the batch are unknown, or no
            target of either kind fits its loss.
    """
    rng = np.random.default_rng(seed)
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            "`--model` must be a functional or sequential model (with known "
            "inputs) to build a synthetic batch. Received a model without "
            "`inputs`. Fix: profile it from Python with "
            "`keras_fastgrad.profile_step(model, (x, y))` on real data."
        )
    for t in inputs:
        if any(d is None for d in t.shape[1:]):
            raise ValueError(
                "The model's input dimensions besides the batch must be known "
                f"to build a synthetic batch. Received input shape {t.shape}. "
                "Fix: profile it from Python with real data."
            )
    xs = [rng.normal(size=(batch_size, *t.shape[1:])).astype(t.dtype or "float32") for t in inputs]
    x = xs[0] if len(xs) == 1 else xs
    y_pred = model(x, training=False)
    candidates = (
        lambda p: rng.uniform(size=tuple(p.shape)).astype("float32"),
        lambda p: rng.integers(0, max(int(p.shape[-1]), 1), size=tuple(p.shape[:-1])).astype(
            "int32"
        ),
    )
    errors = []
    for make in candidates:
        y = tree.map_structure(make, y_pred)
        try:
            model.compute_loss(x=x, y=y, y_pred=y_pred)
            return x, y
        except Exception as e:  # noqa: BLE001 - try the next kind of target
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    raise ValueError(
        "No synthetic target fits the model's loss (tried floats shaped like "
        f"the outputs and integer labels): {errors}. Fix: profile it from "
        "Python with `keras_fastgrad.profile_step(model, (x, y))`."
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m keras_fastgrad.profile",
        description="Time forward, backward and the full train step of a "
        "Keras model eager, under tf.function, XLA and mixed "
        "precision.",
    )
    parser.add_argument("--model", help="a compiled .keras model (default: built-in MLP)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help=f"batch size (default {BUILTIN_BATCH})"
    )
    parser.add_argument(
        "--modes",
        default=",".join(default_modes()),
        help=f"comma-separated subset of {','.join(MODES)} (default: every mode "
        "the backend has; on JAX all but function)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 20, 5 with --quick)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls per function (default 3, 1 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="few rounds: a fast look")
    parser.add_argument("--png", help="also save a bar chart to this PNG file")
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)  # usage and the message on stderr, exit status 2
    return args


def default_modes():
    """Every mode, but `function` on JAX (TensorFlow's graph without XLA:
    no JAX counterpart; `profile_step` would report it skipped)."""
    if keras.backend.backend() == "jax":
        return tuple(m for m in MODES if m != "function")
    return tuple(MODES)


def check_args(args):
    """The first problem with the parsed `args`, as a message, or None.

    Checked before anything is loaded or built, so a bad command line ends
    with one message (through `parser.error`) instead of a traceback.

    Example:

    >>> check_args(parse_args([]))  # the defaults are fine
    >>> check_args(argparse.Namespace(model=None, batch_size=None, modes="xla",
    ...                               repeats=0, warmup=None))
    '`--repeats` must be an integer >= 1 (timed rounds). Received: --repeats=0'
    """
    for flag, value, meaning in (
        ("--repeats", args.repeats, " (timed rounds)"),
        ("--warmup", args.warmup, " (untimed calls per function)"),
        ("--batch-size", args.batch_size, " (samples per profiled batch)"),
    ):
        if value is not None and value < 1:
            return f"`{flag}` must be an integer >= 1{meaning}. Received: {flag}={value}"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        return (
            f"`--modes` must be a comma-separated list of names from "
            f"{','.join(MODES)}. Received: --modes={args.modes!r}"
            + (f" (unknown: {','.join(unknown)})" if unknown else "")
        )
    if args.model is not None and not os.path.isfile(args.model):
        reason = "a directory" if os.path.isdir(args.model) else "no such file"
        return (
            "`--model` must be the path of an existing `.keras` file. "
            f"Received: --model={args.model!r} ({reason}). Fix: check the "
            "path, or leave `--model` out to profile the built-in model."
        )
    return None


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    batch_size = args.batch_size or BUILTIN_BATCH
    if args.model:
        model = keras.models.load_model(args.model)
        data = synthetic_batch(model, batch_size)
    else:
        model, data = builtin_model(), builtin_data(batch_size)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    profile = profile_step(model, data, modes=modes, repeats=repeats, warmup=warmup)
    if args.png:
        profile.save_png(args.png)
        print(f"Bar chart written to {args.png}")
    return profile


if __name__ == "__main__":
    main()
