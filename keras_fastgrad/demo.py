"""The quick-start job: train on scikit-learn's bundled digits with
accumulation, clipping and in-step telemetry, and print what was measured.

    python -m keras_fastgrad.demo [--epochs 5]

Nothing is downloaded: the 1,797 8x8 digit images ship with scikit-learn.
It also checks the exactness claim on this data: one epoch of FastGradModel
with micro-batches of 32 and `accumulation_steps=4` against `keras.Model`
with batches of 128, and Keras' own `gradient_accumulation_steps=4`.
"""

import argparse
import os

# TensorFlow's C++ logs. (The notices TensorFlow prints while it is
# imported, before it reads this, are held back by the package's import,
# keras_fastgrad/_tf_startup.py: `python -m` imports the package first.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fastgrad  # noqa: E402


def load_digits():
    """Digits as float32 in [0, 1], split 80/20 with a fixed seed."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "sklearn":
            raise
        raise ImportError(missing_scikit_learn(keras.backend.backend())) from None
    digits = sk_load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def missing_scikit_learn(backend):
    """The error's text when scikit-learn is missing: the extra to install.

    >>> print(missing_scikit_learn("jax"))  # doctest: +ELLIPSIS
    The demo needs scikit-learn... Fix: pip install -e ".[jax,demo]" in the repository...
    """
    extras = "jax,demo" if backend == "jax" else "tf-cpu,demo"
    return (
        "The demo needs scikit-learn, for its bundled digits data "
        "(`sklearn.datasets.load_digits`); the `demo` extra installs it. "
        f'Fix: pip install -e ".[{extras}]" in the repository (or pip install scikit-learn).'
    )


def variables_line(backend, measured, trainable):
    """The demo's line on `tape_variables`: what the step took the gradient
    for (a tape's watched variables on TensorFlow; on JAX, where there is no
    tape, the trainable variables `jax.value_and_grad` differentiates).

    >>> variables_line("jax", 6, 6)
    'variables the gradient is taken for (jax.value_and_grad): 6 of 6 trainable'
    """
    what = (
        "variables the gradient is taken for (jax.value_and_grad)"
        if backend == "jax"
        else "variables watched by the gradient tape"
    )
    return f"{what}: {measured} of {trainable} trainable"


def build(cls, seed=0, **options):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(128, activation="relu", name="hidden_1")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="hidden_2")(h)
    outputs = keras.layers.Dense(10, name="logits")(h)
    return cls(inputs, outputs, **options)


def compile_model(model, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def exactness_check(x, y):
    """One epoch, 1437 samples: windows of 4 x 32 vs batches of 128."""
    big = compile_model(build(keras.Model), keras.optimizers.SGD(0.1))
    ours = compile_model(
        build(keras_fastgrad.FastGradModel, accumulation_steps=4),
        keras.optimizers.SGD(0.1),
    )
    theirs = compile_model(
        build(keras.Model), keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    )
    big.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0)
    ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    theirs.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return max_diff(big, ours), max_diff(big, theirs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    (x, y), (x_test, y_test) = load_digits()
    model = compile_model(
        build(keras_fastgrad.FastGradModel, accumulation_steps=4, clip_norm=1.0),
        keras.optimizers.Adam(3e-3),
    )
    logger = keras_fastgrad.callbacks.GradientNormLogger()
    model.enable_telemetry(["updates", "clipped_updates", "nonfinite_count"])
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=args.epochs,
        shuffle=True,
        verbose=0,
        callbacks=[logger],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)

    print("keras_fastgrad demo: digits (scikit-learn), 1437 train / 360 test")
    print("FastGradModel(accumulation_steps=4, clip_norm=1.0), micro-batches of 32")
    print(
        f"{'epoch':>5} {'loss':>8} {'accuracy':>9} {'grad_norm':>10} {'updates':>8} {'clipped':>8}"
    )
    for e in range(args.epochs):
        h = {k: v[e] for k, v in history.history.items()}
        print(
            f"{e + 1:5d} {h['loss']:8.4f} {h['accuracy']:9.4f} {h['grad_norm']:10.4f} "
            f"{int(h['updates']):8d} {int(h['clipped_updates']):8d}"
        )
    print(f"test accuracy: {accuracy:.4f}")
    print(
        f"optimizer updates: {int(model.optimizer.iterations.numpy())} "
        f"(ceil(45 batches / 4) = 12 per epoch, the last window partial)"
    )
    print(f"dropped non-finite micro-batches: {int(history.history['nonfinite_count'][-1])}")
    print(
        variables_line(
            keras.backend.backend(), model.tape_variable_count, len(model.trainable_variables)
        )
    )
    ours, theirs = exactness_check(x, y)
    print("exactness, one epoch vs keras.Model with batch 128 (max |weight diff|):")
    print(f"  FastGradModel(accumulation_steps=4):          {ours:.2e}")
    print(
        f"  keras SGD(gradient_accumulation_steps=4):     {theirs:.2e}"
        "  (short last window weighted like a full one)"
    )
    return {"accuracy": accuracy, "exact_diff": ours, "keras_diff": theirs}


if __name__ == "__main__":
    main()
