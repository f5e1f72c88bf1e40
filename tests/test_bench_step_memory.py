"""benchmarks/bench_step_memory.py (issue 48): its arguments are checked
before any process starts, and a small run reads the allocator's figures
and prints each configuration against its anchor."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="benchmarks/bench_step_memory.py runs the TensorFlow step"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_step_memory_under_test", os.path.join(ROOT, "benchmarks", "bench_step_memory.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--models", "resnet"],
            "`--models` takes names from conv, mlp. Received: --models=resnet",
        ),
        (["--models", ""], "`--models` takes names"),
        (["--configs", "keras,micro3"], "`--configs` takes names from keras, .*micro3"),
        (["--threads", "4"], "`--threads` takes names from default, 8. Received: --threads=4"),
        (["--reps", "0"], "`--reps` must be an integer >= 1. Received: --reps=0"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(bench, monkeypatch, argv, match):
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("a process started"))
    with pytest.raises(ValueError, match=match):
        bench.main(argv)


def test_every_anchor_is_a_configuration_measured_before_it(bench):
    names = list(bench.CONFIGS)
    for name, (_, _, _, anchor) in bench.CONFIGS.items():
        assert anchor is None or names.index(anchor) < names.index(name)


def test_rows_give_ratios_to_the_anchor_and_the_unsplit_step(bench):
    mb = bench.MB

    def results(model, gradient_mb):
        run = lambda peak, working: [  # noqa: E731
            {"peak": peak * mb, "working": working * mb, "gradient": gradient_mb * mb}
        ]
        measured = {"keras_gated": run(100, 40), "default": run(100, 40), "micro4": run(110, 10)}
        return {(model, config, "8"): runs for config, runs in measured.items()}

    lines = bench.rows(results("mlp", 10), "mlp", "8")
    assert lines[0] == "mlp, gradient 10.0 MB, threads 8:"
    assert "/ keras_gated: peak 1.00, working 1.00, +0.00 gradients" in lines[2]
    assert "/ keras_gated: peak 1.10, working 0.25, +1.00 gradients" in lines[3]
    assert "working / default's 0.25  [working MB each run: [10.0]]" in lines[3]
    # Activations dominate: no gradient-sized buffers to count, the 1.15/m target.
    lines = bench.rows(results("conv", 0.01), "conv", "8")
    assert (
        "/ keras_gated: peak 1.10, working 0.25  working / default's 0.25 (target <= 0.29)"
        in (lines[3])
    )


def test_a_small_run_reads_the_allocators_peak(bench, capsys):
    argv = ["--models", "conv", "--configs", "default,micro2", "--threads", "default"]
    results = bench.main([*argv, "--reps", "1"])
    assert set(results) == {("conv", "default", "default"), ("conv", "micro2", "default")}
    for (run,) in results.values():
        assert run["peak"] >= run["working"] > 0 and run["gradient"] > 0
    out = capsys.readouterr().out
    assert "allocator peak, tensors >= 256 KiB" in out
    assert "working / default's" in out


def test_mixed_runs_every_process_under_mixed_float16(bench, monkeypatch):
    envs = []

    def run(command, env, **kwargs):
        envs.append(env[bench.POLICY_VARIABLE])
        figures = '{"peak": 2, "working": 1, "gradient": 1}'
        return type("Done", (), {"stdout": figures})()

    monkeypatch.setattr(bench.subprocess, "run", run)
    argv = ["--models", "mlp", "--configs", "keras,acc4", "--threads", "default", "--reps", "1"]
    bench.main([*argv, "--mixed"])
    bench.main(argv)
    assert envs == ["mixed_float16", "mixed_float16", "", ""]
