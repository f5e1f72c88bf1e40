"""benchmarks/ab_micro_batches.py (issue 48's step-time A/B): its arguments
are refused before any model is built, its "before" side traces the code
that c3febfa and fd57dc7 replaced (and trains as the current code does),
the patches are lifted afterwards, and a tiny run prints every row."""

import importlib.util
import os

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="benchmarks/ab_micro_batches.py runs the TensorFlow step"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location(
        "ab_micro_batches_under_test", os.path.join(ROOT, "benchmarks", "ab_micro_batches.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(model_name, options):
    """A small Dense net in place of bench_step_memory's models."""
    import keras_fastgrad

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(3)(hidden), **options)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    return model, x, rng.integers(0, 3, size=(32,)).astype("int32"), 8


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--pairs", "resnet"], "`--pairs` takes names from conv_m2, .*Received: --pairs=resnet"),
        (["--pairs", ""], "`--pairs` takes names"),
        (["--rounds", "0"], "`--rounds` must be an integer >= 1. Received: --rounds=0"),
    ],
)
def test_bad_arguments_are_refused_before_any_model_is_built(ab, monkeypatch, argv, match):
    monkeypatch.setattr(ab, "build_model", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=match):
        ab.main(argv)


def test_the_patches_are_lifted_even_when_the_build_fails(ab):
    from keras_fastgrad.backend.tensorflow import accumulation, slicing

    before = (slicing._PARALLEL_ITERATIONS, slicing._unset, slicing._added)
    reset = accumulation.reset
    with pytest.raises(KeyError), ab.code("before", {}):
        assert slicing._PARALLEL_ITERATIONS == 10
        raise KeyError("a failed build")
    assert (slicing._PARALLEL_ITERATIONS, slicing._unset, slicing._added) == before
    assert accumulation.reset is reset


SIDES = ("before", "serial", "after")


@pytest.mark.parametrize("options", [{"micro_batches": 2}, {"accumulation_steps": 2}])
def test_both_sides_train_alike_and_trace_their_own_code(ab, options):
    weights, traces = [], []
    for side in SIDES:
        seen = {}
        with ab.code(side, seen):
            model, x, y, batch = tiny("mlp", options)
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        weights.append(model.get_weights())
        traces.append(ab.traced(seen))
    for other in weights[1:]:
        for old, new in zip(weights[0], other):
            np.testing.assert_allclose(old, new, rtol=1e-5, atol=1e-6)
    micro = "micro_batches" in options
    for side, what in zip(SIDES, traces):
        for words in ab.EXPECTED[side, micro]:
            assert words in what


def test_a_tiny_run_prints_every_row_with_its_verdict(ab, monkeypatch, capsys):
    import harness

    monkeypatch.setattr(ab, "build_model", tiny)
    reported = {}
    monkeypatch.setattr(harness, "report", lambda *a, **k: reported.update(results=a[1]))
    results = ab.main(["--quick", "--rounds", "1", "--pairs", "mlp_m2,mlp_acc4,mlp_m8_same"])
    out = capsys.readouterr().out
    assert list(results) == list(reported["results"])
    assert len(results) == 3
    assert (
        "mlp micro_batches=2: after / before | before: slices' loop parallel_iterations=[10]" in out
    )
    assert "after: slices' loop parallel_iterations=[1]; sums start from Empty, added cond" in out
    assert "window emptied with zeros_like" in out
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("pair ")) + 1 :]
    assert len(table) == 3
    for label, stats in results.items():
        assert {"median", "min", "max", "best", "mean"} <= set(stats)
        row = next(line for line in table if line.startswith(label + " "))
        if label.endswith("(A/A)"):
            assert "<= 1.03" not in row
        else:
            assert stats["verdict"] in ("met", "not met", "noisy")
            assert row.endswith(f"<= 1.03: {stats['verdict']}")
