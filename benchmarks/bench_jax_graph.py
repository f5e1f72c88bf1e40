"""What the jitted train step holds on Keras' JAX backend: op counts,
FastGradModel / keras.Model (issue 29; `bench_graph.py` does this on
TensorFlow).

    python benchmarks/bench_jax_graph.py [--models a,b]

Step times on JAX spread by +-10% per round on a 2-core machine (the A/A
rows of `bench_jax.py`): a 3% target sits inside that. The program does
not move: this lowers each side's `train_step(state, data)` under
`jax.jit` on one batch, as Keras' JAX trainer jits it, and counts
- `stablehlo`: the StableHLO operations of the lowered step (what the
  step asks XLA for; every `stablehlo.*` / `chlo.*` op and `call`);
- `compiled`: the instructions of XLA's optimised module for this CPU
  (after fusion; every `name = ...` line: parameters and the bodies of
  fused computations included; `fusions` of them are fused kernels). Both branches of
  a `lax.cond` count, though one runs: a gated update holds the
  optimizer's code once in its taken branch, where Keras' accumulation
  runs the optimizer every micro-step and selects (one copy, always run).
Not a time: an op on a scalar counts as much as a matmul. The sides are
bench_jax's: FastGradModel default, `skip_nonfinite=False`, accumulation 4
(with and without `skip_nonfinite`, BatchNorm statistics per micro-batch)
against `keras.Model`, the gated anchor (`anchors_jax.JaxGatedModel`:
Keras' JAX `train_step` with its update in a `lax.cond` on a finite
gradient) and Keras' `gradient_accumulation_steps=4`. Reported, no
target: the time targets are `bench_jax.py`'s.

Models (`--models`, any of bench_targets' builders): `mlp_64x256_b64` and
`transformer` by default. About a minute on 2 cores (14 lowerings and compilations):
not in `run_all`'s quick set; `run_all.py --only jax_graph` runs it.

Writes benchmarks/out/jax_graph.json.
"""

import os
import re

os.environ["KERAS_BACKEND"] = "jax"  # before Keras loads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

OWN_PROCESS = True  # the backend is chosen when Keras is first imported

import argparse  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
from anchors_jax import JaxGatedModel  # noqa: E402
from bench_jax import MICRO_BATCH_BN  # noqa: E402
from bench_targets import MODELS  # noqa: E402
from harness import report  # noqa: E402
from sides import jax_state  # noqa: E402

import keras_fastgrad  # noqa: E402

NAMES = ["mlp_64x256_b64", "transformer"]
SIDES = {
    "keras": (keras.Model, {}, {}),
    "gated": (JaxGatedModel, {}, {}),
    "default": (keras_fastgrad.FastGradModel, {}, {}),
    "unsafe": (keras_fastgrad.FastGradModel, {"skip_nonfinite": False}, {}),
    "keras_acc": (keras.Model, {}, {"gradient_accumulation_steps": 4}),
    "acc": (keras_fastgrad.FastGradModel, {"accumulation_steps": 4, **MICRO_BATCH_BN}, {}),
    "acc_unsafe": (
        keras_fastgrad.FastGradModel,
        {"accumulation_steps": 4, "skip_nonfinite": False, **MICRO_BATCH_BN},
        {},
    ),
}
ROWS = [
    ("default / keras.Model gated on finite gradients", "default", "gated"),
    ("default / keras.Model (not gated)", "default", "keras"),
    ("keras.Model gated / keras.Model (the gate alone)", "gated", "keras"),
    ("skip_nonfinite=False / keras.Model", "unsafe", "keras"),
    (
        "accumulation_steps=4, skip_nonfinite=False / gradient_accumulation_steps=4",
        "acc_unsafe",
        "keras_acc",
    ),
    ("accumulation_steps=4 / gradient_accumulation_steps=4", "acc", "keras_acc"),
]
STABLEHLO_OP = re.compile(r"\b(?:stablehlo|chlo)\.[a-z_]+|\bcall @")
HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = ")


def counts(model_name, side):
    """`(stablehlo, compiled, fusions)` of one side's jitted train step."""
    _, build, data_of, batch, loss, optimizer, _ = MODELS[model_name]
    cls, options, optimizer_options = SIDES[side]
    x, y = data_of(batch * 2)
    model = build(cls, **options)
    model.compile(optimizer=optimizer(**optimizer_options), loss=loss())
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # builds every variable
    state = jax_state(model)  # what `fit` hands the train function
    data = (jax.numpy.asarray(x[:batch]), jax.numpy.asarray(y[:batch]))
    lowered = jax.jit(model.train_step).lower(state, data)
    stablehlo = stablehlo_ops(lowered.as_text())
    instructions, fusions = compiled_instructions(lowered.compile().as_text())
    keras.backend.clear_session()
    return stablehlo, instructions, fusions


def stablehlo_ops(text):
    """The StableHLO operations (`stablehlo.*`, `chlo.*`, `call @`) in a
    lowered program's text."""
    return sum(len(STABLEHLO_OP.findall(line)) for line in text.splitlines())


def compiled_instructions(text):
    """`(instructions, fusions)` of a compiled HLO module's text."""
    instructions = [line for line in text.splitlines() if HLO_INSTRUCTION.match(line)]
    return len(instructions), sum(1 for line in instructions if " fusion(" in line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)}")
    args, _ = parser.parse_known_args(argv)  # (run_all's `--args` for bench_jax: --rounds)
    names = args.models.split(",") if args.models else NAMES
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise ValueError(
            f"`--models` must name models of {list(MODELS)}. Received: {unknown}. "
            "Fix: pick from that list."
        )
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "bench_jax_graph.py counts Keras' JAX backend's step, but Keras was imported "
            f"with {keras.backend.backend()!r}. Fix: run it in its own process "
            "(`python benchmarks/bench_jax_graph.py`)."
        )
    results = {}
    for model_name in names:
        label = MODELS[model_name][0]
        sides = {s: counts(model_name, s) for s in SIDES}
        print(f"{label}: stablehlo ops, compiled instructions (fusions) per jitted train_step")
        for side, (ops, instructions, fusions) in sides.items():
            print(f"  {side:12s} {ops:6d} {instructions:6d} ({fusions})")
        for pair, a, b in ROWS:
            for kind, i in (("stablehlo ops", 0), ("compiled instructions", 1)):
                ratio = sides[a][i] / sides[b][i]
                results[f"JAX {label}: {kind}: {pair}"] = {
                    "median": ratio,
                    "min": ratio,
                    "max": ratio,
                    "rounds": 1,
                    "kind": f"{kind} (not a time)",
                    "counts": [sides[a][i], sides[b][i]],
                    "fusions": [sides[a][2], sides[b][2]],
                }
    report(
        f"Ops in the jitted JAX train step (jax {jax.__version__}; exact, not a time)",
        results,
        {},
        "jax_graph",
    )


if __name__ == "__main__":
    main()
