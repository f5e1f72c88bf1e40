"""Issue 29's speed rows: FastGradModel's JAX step against keras.Model on JAX.

    python benchmarks/bench_jax.py [--models a,b] [--rounds N]

Runs on Keras' JAX backend (the script sets `KERAS_BACKEND=jax` before
Keras loads: its own process under `run_all.py`, which runs it in the full
mode only). Step-level, as every ratio of the project: each side's jitted
`train_function` (what Keras' JAX `fit` calls per batch) is called with
the state threaded through it as `fit` does, and each step is timed until
its outputs and state are ready (`jax.block_until_ready`: JAX dispatches
asynchronously); rounds interleaved, order alternating
(`harness.interleaved_step_ratios`).

Rows (targets from issue 29):
- default / keras.Model: reported (the default step's update waits for
  its finite check; there is no gated keras.Model anchor on JAX yet);
- `skip_nonfinite=False` / keras.Model;
- accumulation 4, `skip_nonfinite=False` / Keras' own
  `gradient_accumulation_steps=4`                                <= 1.02;
- accumulation 4 (safe) / Keras' own accumulation: reported;
- `clip_norm=1` / `global_clipnorm=1`: reported.

Models (`--models`): `mlp_64x256_b64`, `mlp_256x1024_b64` and
`transformer`, bench_targets' builders and data. 8 rounds of 24 steps
(the transformer: 48).

Writes benchmarks/out/jax.json.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # before Keras loads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

OWN_PROCESS = True  # the backend is chosen when Keras is first imported

import time  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
from bench_targets import MODELS  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402

import keras_fastgrad  # noqa: E402

NAMES = ["mlp_64x256_b64", "mlp_256x1024_b64", "transformer"]
SIDES = {
    "default": ("fg", {}, {}),
    "unsafe": ("fg", {"skip_nonfinite": False}, {}),
    "acc": ("fg", {"accumulation_steps": 4}, {}),
    "acc_unsafe": ("fg", {"accumulation_steps": 4, "skip_nonfinite": False}, {}),
    "clip": ("fg", {"clip_norm": 1.0}, {}),
    "keras": ("keras", {}, {}),
    "keras_acc": ("keras", {}, {"gradient_accumulation_steps": 4}),
    "keras_clip": ("keras", {}, {"global_clipnorm": 1.0}),
}
ROWS = [  # (pair, numerator, denominator, target)
    ("default / keras.Model", "default", "keras", None),
    ("skip_nonfinite=False / keras.Model", "unsafe", "keras", None),
    (
        "accumulation_steps=4, skip_nonfinite=False / gradient_accumulation_steps=4",
        "acc_unsafe",
        "keras_acc",
        "<= 1.02",
    ),
    ("accumulation_steps=4 / gradient_accumulation_steps=4", "acc", "keras_acc", None),
    ("clip_norm=1 / global_clipnorm=1", "clip", "keras_clip", None),
]


def jax_step_fn(model, x, y, batch, steps):
    """A zero-argument function timing `steps` train steps of `model` on
    Keras' JAX backend (its jitted `train_function`, the state threaded as
    `fit` threads it); built and traced by one short `fit`."""
    model.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, epochs=1, verbose=0)
    function = model.train_function
    state = [
        model._get_jax_state(  # what `fit` hands the train function
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
            purge_model_variables=False,
        )
    ]
    batches = [
        (jax.numpy.asarray(x[i : i + batch]), jax.numpy.asarray(y[i : i + batch]))
        for i in range(0, len(x) - batch + 1, batch)
    ]

    def step(i):
        logs, state[0] = function(state[0], iter([batches[i % len(batches)]]))
        jax.block_until_ready((logs, state[0]))

    for i in range(steps):  # warm-up (a first call may trace again)
        step(i)

    def run():
        seconds = []
        for i in range(steps):
            start = time.perf_counter()
            step(i)
            seconds.append(time.perf_counter() - start)
        return seconds

    return run


def side(name, model_name, steps):
    _, build, data_of, batch, loss, optimizer, _ = MODELS[model_name]
    kind, options, optimizer_options = SIDES[name]
    x, y = data_of(batch * 16)
    model = build(keras_fastgrad.FastGradModel if kind == "fg" else keras.Model, **options)
    model.compile(optimizer=optimizer(**optimizer_options), loss=loss())
    return jax_step_fn(model, x, y, batch, steps)


def main(argv=None):
    args, rounds, steps, names = command_line(__doc__, (4, 12), (8, 24), NAMES, argv=argv)
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "bench_jax.py times Keras' JAX backend, but Keras was imported with "
            f"{keras.backend.backend()!r}. Fix: run it in its own process "
            "(`python benchmarks/bench_jax.py`)."
        )
    results, targets = {}, {}
    for model_name in names:
        label, *_, scale = MODELS[model_name]
        n = max(4, int(steps * scale) // 4 * 4)
        sides = {
            s: side(s, model_name, n) for s in dict.fromkeys(r[i] for r in ROWS for i in (1, 2))
        }
        pairs = [(f"JAX {label}: {pair}", sides[a], sides[b]) for pair, a, b, _ in ROWS]
        measured = interleaved_step_ratios(pairs, rounds)
        for (pair, *_, target), name in zip(ROWS, measured):
            if target:
                targets[name] = target
        results.update(measured)
        keras.backend.clear_session()
    report(
        f"Issue 29's rows on Keras' JAX backend (jax {jax.__version__}, step-level, "
        f"{rounds} rounds of {steps} steps x each model's scale)",
        results,
        targets,
        "jax",
    )


if __name__ == "__main__":
    main()
