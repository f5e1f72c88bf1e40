"""benchmarks/anchors.py: the gated `keras.Model` the target table measures
against takes the same steps as `keras.Model` itself (the reference) on
finite batches, dense, BatchNorm and sparse-embedding models and with the
optimizer's own accumulation, and leaves weights and optimizer untouched
on a non-finite gradient."""

import importlib.util
import os
import types

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="benchmarks/bench_targets.py runs the TensorFlow step"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def anchors():
    spec = importlib.util.spec_from_file_location(
        "anchors_under_test", os.path.join(ROOT, "benchmarks", "anchors.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def fresh_session():
    keras.backend.clear_session()
    yield
    keras.backend.clear_session()


def dense(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3)(h))


def batchnorm(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    return cls(inputs, keras.layers.Dense(3)(h))


def embedding(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(50, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(3)(h))


def batches(model_name, n=4, seed=0):
    rng = np.random.default_rng(seed)
    if model_name == "embedding":
        x = rng.integers(0, 50, size=(n * 8, 5)).astype("int32")
    elif model_name == "batchnorm":
        x = rng.normal(size=(n * 8, 6, 6, 1)).astype("float32")
    else:
        x = rng.normal(size=(n * 8, 6)).astype("float32")
    return x, rng.integers(0, 3, size=(n * 8,)).astype("int32")


BUILDERS = {"dense": dense, "batchnorm": batchnorm, "embedding": embedding}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def trained(anchors, build, cls_is_gated, x, y, **optimizer_options):
    model = anchors.keras_model(
        build, cls_is_gated, keras.optimizers.Adam(1e-2, **optimizer_options), LOSS
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, history.history["loss"][0]


def check_trains_like_keras_model(anchors, name, accumulation, **options):
    x, y = batches(name)
    if accumulation:
        options["gradient_accumulation_steps"] = accumulation
    reference, reference_loss = trained(anchors, BUILDERS[name], False, x, y, **options)
    assert type(reference).__name__ == "Functional"  # plain keras.Model
    gated, gated_loss = trained(anchors, BUILDERS[name], True, x, y, **options)
    assert isinstance(gated, anchors.GatedModel)
    np.testing.assert_allclose(gated_loss, reference_loss, rtol=1e-6)
    assert len(gated.variables) == len(reference.variables)
    for mine, theirs in zip(gated.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)
    assert int(gated.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


@pytest.mark.parametrize("name", list(BUILDERS))
def test_gated_anchor_trains_like_keras_model_on_finite_batches(anchors, name):
    check_trains_like_keras_model(anchors, name, None)


def test_gated_anchor_with_accumulation(anchors):
    check_trains_like_keras_model(anchors, "dense", 2)
    check_skips_a_nonfinite_gradient(anchors, "dense", 2)


def test_gated_anchor_with_global_clipnorm(anchors):
    # (the `clip_gated` rows' anchor: Keras' clipping inside the gated update;
    # 0.05 is below these batches' gradient norms, so it clips)
    check_trains_like_keras_model(anchors, "dense", None, global_clipnorm=0.05)


@pytest.mark.parametrize("name", ["batchnorm", "embedding"])
def test_gated_anchor_with_accumulation_on_batchnorm_and_sparse_models(anchors, name):
    check_trains_like_keras_model(anchors, name, 2)
    check_skips_a_nonfinite_gradient(anchors, name, 2)


def test_ungated_copy_is_keras_step(anchors):
    x, y = batches("dense")
    x[3, 0] = np.nan  # Keras' own step lets the NaN through; so must the copy
    reference = anchors.keras_model(dense, False, keras.optimizers.SGD(0.1), LOSS)
    copy = dense(lambda i, o: anchors.GatedModel(i, o, gate=False))
    copy.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    for model in (reference, copy):
        model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    for mine, theirs in zip(copy.trainable_variables, reference.trainable_variables):
        np.testing.assert_array_equal(np.isnan(mine.numpy()), np.isnan(theirs.numpy()))
    assert np.isnan(reference.trainable_variables[0].numpy()).any()


@pytest.mark.parametrize("gated", [False, True])
def test_anchor_with_log_keys_trains_like_keras_model(anchors, gated):
    # (the `callbacks_logs` rows' anchor: Keras' clipping, five more keys)
    x, y = batches("dense")
    options = {"global_clipnorm": 0.05}
    reference, _ = trained(anchors, dense, False, x, y, **options)
    model = anchors.keras_model(
        dense, gated, keras.optimizers.Adam(1e-2, **options), LOSS, extra_logs=5
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert isinstance(model, anchors.GatedModel) and model.gate is gated
    assert [f"log_{i}" for i in range(5)] == [k for k in history.history if k != "loss"]
    for mine, theirs in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_gated_anchor_skips_a_nonfinite_gradient(anchors, name):
    check_skips_a_nonfinite_gradient(anchors, name, None)


def check_skips_a_nonfinite_gradient(anchors, name, accumulation):
    x, y = batches(name, n=1)
    options = {"gradient_accumulation_steps": accumulation} if accumulation else {}
    model = anchors.keras_model(BUILDERS[name], True, keras.optimizers.Adam(1e-2, **options), LOSS)
    model.fit(x, y, batch_size=8, verbose=0)  # one finite step: state exists
    before = [v.numpy().copy() for v in model.variables]
    optimizer_before = [v.numpy().copy() for v in model.optimizer.variables]
    if name == "embedding":
        # A NaN row reached by the batch makes the sparse gradient NaN.
        table = model.layers[1].embeddings
        values = table.numpy()
        values[x[0, 0]] = np.nan
        table.assign(values)
        before = [v.numpy().copy() for v in model.variables]
    else:
        x = x.copy()
        x[0].flat[0] = np.nan
    model.fit(x, y, batch_size=8, verbose=0)
    for old, variable in zip(before, model.variables):
        if "moving" in variable.path:  # BatchNorm statistics move in the forward pass
            continue
        np.testing.assert_array_equal(variable.numpy(), old)
    for old, variable in zip(optimizer_before, model.optimizer.variables):
        np.testing.assert_array_equal(variable.numpy(), old)


@pytest.fixture
def bench_targets(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_targets

    reported = {}
    monkeypatch.setattr(  # leaves benchmarks/out/ alone
        bench_targets,
        "report",
        lambda title, results, targets, out, entries=None: reported.update(locals()),
    )
    return bench_targets, reported


def test_bench_targets_main_times_a_row_against_its_anchor(bench_targets, tmp_path):
    module, reported = bench_targets
    table = tmp_path / "table.md"
    argv = ["--quick", "--rounds", "1", "--models", "mlp_64x256_b64", "--rows", "gated,agc"]
    module.main([*argv, "--cpu", "--markdown", str(table)])
    names = [
        "MLP 64-3x256-10: default / keras.Model gated on finite gradients",
        "MLP 64-3x256-10: clip_adaptive=0.01 / default",
    ]
    assert list(reported["results"]) == names
    assert reported["targets"] == {names[0]: "<= 1.03", names[1]: "<= 1.06"}
    assert reported["out"] == "targets"
    assert reported["entries"] == {"build_order": "listed"}  # (not under run_all: process 1)
    for stats in reported["results"].values():
        assert stats["rounds"] == 1 and stats["median"] > 0 and len(stats["step_ms"]) == 2
    assert all(name in table.read_text() for name in names)
    with pytest.raises(ValueError, match="`--rows` must name rows"):
        module.main(["--rows", "nope", "--models", "mlp_64x256_b64"])
    with pytest.raises(ValueError, match="`--mixed` is a GPU-only mode"):
        module.main(["--mixed", "--cpu"])


def test_step_ratios_interleave_blocks_and_judge_the_median_step(monkeypatch):
    # Two stand-in sides of 10 steps a round: A's steps take 2 s except a
    # few outliers, B's 1 s. Worked by hand: blocks of 4, 4, 2 steps,
    # A B B A A B in round 0 and B A A B B A in round 1 (after one untimed
    # whole call of each); the median step ratio is 2 whatever the outliers.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import harness

    calls = []

    def side(name, seconds):
        def run(count=None):
            calls.append((name, count))
            return [seconds(len(calls), i) for i in range(10 if count is None else count)]

        run.steps = 10
        return run

    a = side("A", lambda call, i: 50.0 if (call, i) == (3, 0) else 2.0)
    b = side("B", lambda call, i: 1.0)
    results = harness.interleaved_step_ratios([("a / b", a, b)], rounds=2)
    round_0 = [("A", 4), ("B", 4), ("B", 4), ("A", 4), ("A", 2), ("B", 2)]
    round_1 = [("B", 4), ("A", 4), ("A", 4), ("B", 4), ("B", 2), ("A", 2)]
    assert calls == [("A", None), ("B", None), *round_0, *round_1]
    stats = results["a / b"]
    assert stats["median"] == 2.0 and stats["step_p25"] == 2.0 and stats["rounds"] == 2
    assert stats["min"] == stats["max"] == 2.0  # each round's median steps: 2 / 1
    assert stats["best"] == 20.0 / 10.0  # A's round without the outlier, over B's
    assert stats["step_ms"] == [2000.0, 1000.0]
    whole = lambda: [3.0]  # noqa: E731  (no `.steps`: one call a side and round)
    assert harness.interleaved_step_ratios([("w", whole, b)], rounds=1)["w"]["median"] == 3.0
    b.steps = 12
    with pytest.raises(ValueError, match="as many steps a round"):
        harness.interleaved_step_ratios([("a / b", a, b)], rounds=1)


def test_even_processes_build_the_sides_in_reverse_order(bench_targets, monkeypatch):
    # `run_all --processes N` numbers its processes; the sides of the rows
    # `gated` (default, keras_gated) and `acc_same` (keras_acc_twin,
    # keras_acc) are built in that order in process 1, reversed in 2.
    module, _ = bench_targets
    built = []
    monkeypatch.setattr(module, "timed_side", lambda side, *rest: built.append(side) or side)
    monkeypatch.setattr(module, "interleaved_step_ratios", lambda pairs, rounds: {})
    listed = ["default", "keras_gated", "keras_acc_twin", "keras_acc"]
    for process, order, expected in (
        ("1", "alternate", listed),
        ("2", "alternate", listed[::-1]),
        ("2", "listed", listed),
        ("1", "reversed", listed[::-1]),
    ):
        monkeypatch.setenv("FASTGRAD_BENCH_PROCESS", process)
        args = types.SimpleNamespace(
            rows="gated,acc_same",
            quick=False,
            models=None,
            mixed=False,
            xla=False,
            build_order=order,
        )
        built.clear()
        module.measure("mlp_64x256_b64", args, rounds=1, steps=4)
        assert built == expected, (process, order)


@pytest.mark.slow  # two fresh processes: 7 models in graph mode, then 2 under XLA
def test_gpu_check_runs_on_the_cpu(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--cpu", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "gpu_check.md").read_text()
    assert "- graph: ok" in table and "- XLA: ok" in table
    assert "mixed_float16" not in table.split("Phases:")[1]  # GPU-only: left out
    for row in (  # every row the GPU run times, built and timed in graph mode
        "default / keras.Model gated on finite gradients | <= 1.03 |",
        "default / keras.Model (not gated) |  |",
        "accumulation_steps=4 / gradient_accumulation_steps=4 gated | <= 1.03 |",
        "clip_norm=1 / global_clipnorm=1 | <= 1.05 |",
    ):
        assert f"| MLP 64-3x256-10: {row}" in table, row
    assert "default / keras.Model gated on finite gradients [XLA] | <= 1.03 |" in table
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["targets.json", "targets_xla.json"]


@pytest.fixture
def instance_spread(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import instance_spread

    return instance_spread


def test_instance_spread_times_every_cross_pair_and_each_sides_consecutive_instances(
    instance_spread,
):
    results = instance_spread.main(["--instances", "2", "--rounds", "1"])
    cross = [f"default{i} / keras_gated{j}" for i in range(2) for j in range(2)]
    assert list(results) == [*cross, "default0 / default1", "keras_gated0 / keras_gated1"]
    for stats in results.values():
        assert stats["rounds"] == 1 and stats["median"] > 0 and len(stats["step_ms"]) == 2


def test_instance_spread_refuses_bad_arguments(instance_spread):
    with pytest.raises(ValueError, match="`--sides` must name two keys"):
        instance_spread.main(["--sides", "default"])
    with pytest.raises(ValueError, match="`--instances` must be at least 2"):
        instance_spread.main(["--instances", "1"])


def test_executed_nodes_reads_the_lowered_graph_each_side_ran(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import executed_nodes

    counts = executed_nodes.main(["--sides", "clip,keras_clip_gated"])
    for side in ("clip", "keras_clip_gated"):  # each `cond` lowered: no `If` runs
        assert counts[side]["Switch"] > 8 and counts[side]["Merge"] >= 1
        assert not counts[side]["If"] and not counts[side]["StatelessIf"]
    assert counts["clip"]["L2Loss"] >= 8 and counts["keras_clip_gated"]["Square"] >= 8


def test_step_phases_times_each_phase_of_both_sides_and_the_tail(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import step_phases

    result = step_phases.main(["--steps", "8", "--rounds", "2"])
    for side in (0, 1):
        first, backprop, end = (result[k][side] for k in ("first op", "backprop end", "call end"))
        assert 0 < first < backprop < end
        assert result["ops after the last branch op (tail)"][side] >= 1  # (the outputs' op)
