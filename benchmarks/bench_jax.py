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
- default (safe) / keras.Model with its update gated on every gradient
  finite (`anchors_jax.JaxGatedModel`)                           <= 1.03;
- default / keras.Model: reported (the gate's cost);
- `skip_nonfinite=False` / keras.Model: reported;
- accumulation 4, `skip_nonfinite=False` / Keras' own
  `gradient_accumulation_steps=4`                                <= 1.02;
- accumulation 4 (safe) / Keras' accumulation with the same gate <= 1.03
  (both accumulation rows with `batchnorm_statistics="micro_batch"`, the
  moving statistics as Keras' accumulation moves them);
- `clip_norm=1` / `global_clipnorm=1`: reported;
- `clip_norm=1` / `global_clipnorm=1` gated the same way          <= 1.02
  (issue 50: the clip factor applied inside the gated update, as Keras
  applies its own inside the optimizer's);
- A/A: keras.Model / a second one alike, and the same for Keras'
  accumulation (no target: the method's own noise on that model).

Models (`--models`): `mlp_64x256_b64`, `mlp_256x1024_b64`, `cnn_bn` and
`transformer`, bench_targets' builders and data. 8 rounds of 24 steps
times each model's scale.

Writes benchmarks/out/jax.json.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # before Keras loads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

OWN_PROCESS = True  # the backend is chosen when Keras is first imported

import jax  # noqa: E402
import keras  # noqa: E402
from anchors_jax import JaxGatedModel  # noqa: E402
from bench_targets import MODELS, steps_on  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import jax_step_fn  # noqa: E402

import keras_fastgrad  # noqa: E402

NAMES = ["mlp_64x256_b64", "mlp_256x1024_b64", "cnn_bn", "transformer"]
# BatchNorm's moving statistics moved by each micro-batch, as Keras' own
# accumulation moves them (the window's pooled statistics, the default, are
# not on JAX yet); a no-op on the models without BatchNorm.
MICRO_BATCH_BN = {"batchnorm_statistics": "micro_batch"}
SIDES = {
    "default": ("fg", {}, {}),
    "unsafe": ("fg", {"skip_nonfinite": False}, {}),
    "acc": ("fg", {"accumulation_steps": 4, **MICRO_BATCH_BN}, {}),
    "acc_unsafe": ("fg", {"accumulation_steps": 4, "skip_nonfinite": False, **MICRO_BATCH_BN}, {}),
    "clip": ("fg", {"clip_norm": 1.0}, {}),
    "keras": ("keras", {}, {}),
    "keras_twin": ("keras", {}, {}),
    "keras_gated": ("gated", {}, {}),
    "keras_acc": ("keras", {}, {"gradient_accumulation_steps": 4}),
    "keras_acc_twin": ("keras", {}, {"gradient_accumulation_steps": 4}),
    "keras_acc_gated": ("gated", {}, {"gradient_accumulation_steps": 4}),
    "keras_clip": ("keras", {}, {"global_clipnorm": 1.0}),
    "keras_clip_gated": ("gated", {}, {"global_clipnorm": 1.0}),
}
ROWS = [  # (pair, numerator, denominator, target)
    ("default / keras.Model gated on finite gradients", "default", "keras_gated", "<= 1.03"),
    ("default / keras.Model (not gated)", "default", "keras", None),
    ("skip_nonfinite=False / keras.Model", "unsafe", "keras", None),
    (
        "accumulation_steps=4, skip_nonfinite=False / gradient_accumulation_steps=4",
        "acc_unsafe",
        "keras_acc",
        "<= 1.02",
    ),
    (
        "accumulation_steps=4 / gradient_accumulation_steps=4 gated",
        "acc",
        "keras_acc_gated",
        "<= 1.03",
    ),
    ("clip_norm=1 / global_clipnorm=1", "clip", "keras_clip", None),
    (
        "clip_norm=1 / global_clipnorm=1 gated on finite gradients",
        "clip",
        "keras_clip_gated",
        "<= 1.02",
    ),
    ("keras.Model / keras.Model alike (A/A: the noise)", "keras_twin", "keras", None),
    (
        "gradient_accumulation_steps=4 / the same alike (A/A: the noise)",
        "keras_acc_twin",
        "keras_acc",
        None,
    ),
]


def side(name, model_name, steps):
    _, build, data_of, batch, loss, optimizer, _ = MODELS[model_name]
    kind, options, optimizer_options = SIDES[name]
    x, y = data_of(batch * 16)
    cls = {"fg": keras_fastgrad.FastGradModel, "gated": JaxGatedModel, "keras": keras.Model}[kind]
    model = build(cls, **options)
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
        label = MODELS[model_name][0]
        n = steps_on(model_name, steps)
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
