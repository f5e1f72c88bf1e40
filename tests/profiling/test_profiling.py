"""`keras_fastgrad.profile_step` and `python -m keras_fastgrad.profile`."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad.profiling import __main__ as profile_cli
from keras_fastgrad.profiling import _runs
from keras_fastgrad.profiling.measure import PhaseTimes, StepProfile
from tests.helpers import tf  # (TensorFlow imported at first use: not on JAX)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ON_JAX = keras.backend.backend() == "jax"
# The compiled step of each backend (as `fit` runs it by default): TF's
# graph (`tf.function`), JAX's `jax.jit` ("xla"; "function" has no JAX
# counterpart: reported skipped, tests/profiling/test_profiling_jax.py).
COMPILED = "xla" if ON_JAX else "function"
COMPILED_LABEL = "jax.jit (XLA)" if ON_JAX else "tf.function"


def mlp(cls=keras_fastgrad.FastGradModel, features=4, width=8, depth=1, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((features,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = cls(inputs, keras.layers.Dense(3)(h), **options)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def subclassed(base):
    """A two-layer subclassed model on `base` (FastGradModel or keras.Model)."""

    class Net(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    Net.__name__ = f"Subclassed{base.__name__}"
    return Net


SubclassedFast = subclassed(keras_fastgrad.FastGradModel)
SubclassedKeras = subclassed(keras.Model)


def batch(n=16, features=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, features)).astype("float32"),
        rng.integers(0, 3, size=(n,)).astype("int32"),
    )


def state_of(model):
    """Every value a train step can change."""
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    if isinstance(model, keras_fastgrad.FastGradModel):
        variables += model.fastgrad_step_state.variables
    return [np.array(v.numpy()) for v in variables]


@pytest.mark.parametrize("cls", [keras_fastgrad.FastGradModel, keras.Model])
def test_phases_are_ordered_on_a_model_big_enough(cls):
    model = mlp(cls, features=256, width=512, depth=3)
    result = keras_fastgrad.profile_step(
        model, batch(128, 256), modes=(COMPILED,), repeats=9, warmup=2, verbose=0
    )
    t = result.phases[COMPILED]
    # Medians of interleaved rounds; 5% slack for a shared machine.
    assert t.forward_ms < t.forward_backward_ms * 1.05, t
    assert t.forward_backward_ms <= t.step_ms * 1.05, t
    assert t.backward_ms == pytest.approx(t.forward_backward_ms - t.forward_ms)
    assert t.update_ms == pytest.approx(t.step_ms - t.forward_backward_ms)
    assert result.traces == 1


@pytest.mark.parametrize(
    "model_fn",
    [
        lambda: mlp(),
        lambda: mlp(keras.Model),
        lambda: SubclassedFast(),
        lambda: SubclassedKeras(),
    ],
    ids=["functional-fastgrad", "functional-keras", "subclassed-fastgrad", "subclassed-keras"],
)
def test_runs_on_functional_and_subclassed_models(model_fn):
    model = model_fn()
    if not model.compiled:
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    result = keras_fastgrad.profile_step(
        model,
        batch(),
        modes=("eager", COMPILED, "mixed_bfloat16"),
        repeats=2,
        warmup=1,
        verbose=0,
    )
    assert list(result.phases) == ["eager", COMPILED, "mixed_bfloat16"], result.skipped
    assert result.tape_variables == result.trainable_variables == 4
    assert result.traces == 1
    assert result.batch_size == 16
    assert result.speedup(COMPILED) > 0
    assert COMPILED_LABEL in result.table()


@pytest.mark.parametrize("cls", [keras_fastgrad.FastGradModel, keras.Model])
def test_weights_and_optimizer_state_are_unchanged(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    h = keras.layers.Dropout(0.5)(h)
    options = {"accumulation_steps": 2} if cls is keras_fastgrad.FastGradModel else {}
    model = cls(inputs, keras.layers.Dense(3)(h), **options)
    model.compile(
        optimizer="adam",
        metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch()
    model.fit(x, y, batch_size=8, verbose=0)  # optimizer state is not zero
    before = state_of(model)
    modes = ("eager", COMPILED)  # (TF's XLA: same restore; it runs in the CLI test)
    result = keras_fastgrad.profile_step(model, (x, y), modes=modes, repeats=2, warmup=1, verbose=0)
    assert set(result.phases) == set(modes), result.skipped
    after = state_of(model)
    assert len(after) == len(before)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=8, verbose=0)  # the model still trains


def test_global_dtype_policy_is_restored(monkeypatch):
    model = mlp()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    result = keras_fastgrad.profile_step(
        model, batch(), modes=(COMPILED, "mixed_float16"), repeats=1, warmup=1, verbose=0
    )
    assert "mixed_float16" in result.phases, result.skipped
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"

    def broken(*args, **kwargs):
        raise RuntimeError("cannot rebuild this model")

    monkeypatch.setattr(keras.saving, "deserialize_keras_object", broken)
    result = keras_fastgrad.profile_step(
        model, batch(), modes=(COMPILED, "mixed_float16"), repeats=1, warmup=1, verbose=0
    )
    assert "cannot rebuild" in result.skipped["mixed_float16"]
    assert list(result.phases) == [COMPILED]
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    assert "skipped: RuntimeError: cannot rebuild" in result.table()


def test_mixed_precision_clone_keeps_options_weights_and_compile():
    model = mlp(accumulation_steps=3, clip_norm=2.0)
    model(np.zeros((1, 4), "float32"))
    clone = _runs.mixed_precision_clone(model, "mixed_float16")
    assert keras.mixed_precision.global_policy().name == "float32"
    assert isinstance(clone, keras_fastgrad.FastGradModel)
    assert (clone.accumulation_steps, clone.clip_norm) == (3, 2.0)
    assert {layer.dtype_policy.name for layer in clone.layers[1:]} == {"mixed_float16"}
    assert isinstance(clone.optimizer, keras.optimizers.LossScaleOptimizer)
    for a, b in zip(model.get_weights(), clone.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.needs_tensorflow(reason="a tf.data pipeline")
def test_dataset_input_is_timed_and_short_batches_are_noticed():
    x, y = batch(10)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # 4, 4, 2
    result = keras_fastgrad.profile_step(
        mlp(), dataset, modes=(COMPILED,), repeats=6, warmup=1, verbose=0
    )
    assert result.batch_size == 4
    assert result.data_ms > 0
    assert result.data_shapes == 2
    assert any("drop_remainder=True" in r for r in result.recommendations())
    assert "input pipeline" in result.table()


def test_keras_tape_watches_frozen_variables_fastgrad_does_not():
    # On JAX there is no tape: both take the gradient for the trainable
    # values only (Keras' JAX step, `jax.value_and_grad`).
    keras_watches = 2 if ON_JAX else 4
    for cls, watched in ((keras.Model, keras_watches), (keras_fastgrad.FastGradModel, 2)):
        model = mlp(cls)
        model.layers[1].trainable = False
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        result = keras_fastgrad.profile_step(
            model, batch(), modes=(COMPILED,), repeats=1, warmup=1, verbose=0
        )
        assert (result.tape_variables, result.trainable_variables) == (watched, 2)
        advice = " ".join(result.recommendations())
        assert ("tape watches 4 variables" in advice) == (watched == 4)


def synthetic_profile(**changes):
    fields = dict(
        model_name="m",
        model_class="Functional",
        batch_size=32,
        repeats=5,
        warmup=1,
        skipped={},
        traces=1,
        tape_variables=4,
        trainable_variables=4,
        phases={"eager": PhaseTimes(10.0, 30.0, 40.0), "function": PhaseTimes(1.0, 3.0, 4.0)},
    )
    fields.update(changes)
    return StepProfile(**fields)


RECOMMENDATION_CASES = [
    ({}, "No bottleneck found"),
    ({"phases": {"function": PhaseTimes(1.0, 5.0, 6.0)}}, "Backward takes 4.0x"),
    ({"phases": {"function": PhaseTimes(1.0, 0.8, 2.0)}}, "Timings are noisy"),
    (
        {"phases": {"function": PhaseTimes(1.0, 2.0, 5.0)}},
        "update (step - forward - backward) takes 60%",
    ),
    ({"traces": 3}, "traced 3 times"),
    ({"data_ms": 9.0, "data_shapes": 1}, "input pipeline is slower than the step"),
    ({"tape_variables": 6}, "tape watches 6 variables"),
    ({"model_mode": "eager"}, "`run_eagerly=False`"),
    (
        {"phases": {"function": PhaseTimes(1.0, 3.0, 4.0), "xla": PhaseTimes(1.0, 2.0, 2.0)}},
        "XLA makes the step 2.00x faster",
    ),
    (
        {
            "model_mode": "xla",
            "phases": {"function": PhaseTimes(1.0, 3.0, 4.0), "xla": PhaseTimes(1.0, 3.0, 8.0)},
        },
        "`jit_compile=False`",
    ),
    (
        {
            "phases": {
                "function": PhaseTimes(1.0, 3.0, 4.0),
                "mixed_float16": PhaseTimes(90.0, 95.0, 100.0),
            }
        },
        "mixed_float16 is slower on this device (0.04x",
    ),
    (
        {
            "phases": {
                "function": PhaseTimes(1.0, 3.0, 4.0),
                "mixed_bfloat16": PhaseTimes(0.5, 1.5, 2.0),
            }
        },
        "set_global_policy('mixed_bfloat16')",
    ),
]


def test_recommendations_follow_the_numbers():
    for changes, expected in RECOMMENDATION_CASES:
        text = str(synthetic_profile(**changes))
        assert expected in text, (changes, text)


def test_png_is_written(tmp_path):
    path = synthetic_profile(data_ms=0.5, data_shapes=1).save_png(str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


BAD_ARGUMENTS = [
    ({"repeats": 0}, ValueError, r"`repeats` must be an integer >= 1.*Received: repeats=0"),
    ({"repeats": 2.5}, TypeError, r"`repeats` must be an integer >= 1.*type float"),
    ({"warmup": 0}, ValueError, r"`warmup` must be an integer >= 1"),
    ({"batch_size": 0}, ValueError, r"`batch_size` must be an integer >= 1"),
    ({"modes": ("gpu",)}, ValueError, r"`modes` must be a non-empty sequence.*'gpu'"),
    ({"modes": ()}, ValueError, r"`modes` must be a non-empty sequence"),
    ({"modes": "eager"}, TypeError, r"`modes` must be a sequence of names"),
    ({"verbose": 2}, ValueError, r"`verbose` must be 0 or 1"),
    ({"data": {"x": 1}}, TypeError, r"`data` must be a batch"),
]


def test_bad_arguments_raise_keras_style_errors():
    model = mlp()
    for kwargs, error, match in BAD_ARGUMENTS:
        arguments = {"model": model, "data": batch(), "verbose": 0, **kwargs}
        with pytest.raises(error, match=match):
            keras_fastgrad.profile_step(**arguments)


@pytest.mark.needs_tensorflow(reason="an empty tf.data pipeline")
def test_bad_model_or_data_raise_clear_errors():
    with pytest.raises(TypeError, match=r"`model` must be a `keras.Model`"):
        keras_fastgrad.profile_step("model", batch())
    inputs = keras.Input((4,))
    uncompiled = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    with pytest.raises(ValueError, match=r"`model` must be compiled.*model.compile"):
        keras_fastgrad.profile_step(uncompiled, batch())
    x, y = batch()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match=r"`batch_size` must be `None`"):
        keras_fastgrad.profile_step(mlp(), dataset, batch_size=4)
    with pytest.raises(ValueError, match=r"empty `tf.data.Dataset`"):
        keras_fastgrad.profile_step(mlp(), dataset.take(0))


def test_every_mode_skipped_still_reports(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("cannot rebuild this model")

    model = mlp()
    monkeypatch.setattr(_runs, "mixed_precision_clone", broken)
    result = keras_fastgrad.profile_step(
        model, batch(), modes=("mixed_bfloat16",), repeats=2, warmup=1, verbose=0
    )
    assert result.phases == {} and result.traces is None
    assert "skipped" in result.table()
    assert result.recommendations() == ["No bottleneck found by these checks."]


def test_array_batch_size_takes_the_first_samples():
    result = keras_fastgrad.profile_step(
        mlp(), batch(64), batch_size=8, modes=(COMPILED,), repeats=1, warmup=1, verbose=0
    )
    assert result.batch_size == 8


def test_cli_profiles_a_saved_model(tmp_path, capsys):
    for loss, name in (
        ("mse", "dense.keras"),
        (keras.losses.SparseCategoricalCrossentropy(from_logits=True), "sparse.keras"),
    ):
        inputs = keras.Input((5,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss=loss)
        model.save(str(tmp_path / name))
        result = profile_cli.main(
            [
                "--model",
                str(tmp_path / name),
                "--modes",
                COMPILED,
                "--batch-size",
                "16",
                "--quick",
            ]
        )
        assert result.batch_size == 16 and COMPILED in result.phases, result.skipped
    assert "Recommendations:" in capsys.readouterr().out


@pytest.mark.slow  # a fresh process
def test_cli_runs_quick_and_writes_the_png(tmp_path):
    png = tmp_path / "profile.png"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        # Two rounds: mixed_float16 takes ~0.4 s a call on a CPU.
        [
            sys.executable,
            "-m",
            "keras_fastgrad.profile",
            "--quick",
            "--repeats",
            "2",
            "--png",
            str(png),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for text in (
        "builtin_mlp",
        "jax.jit (XLA)" if ON_JAX else "tf.function + XLA",
        "mixed_float16",
        "traces of the compiled step: 1",
        "Recommendations:",
    ) + (() if ON_JAX else ("input pipeline",)):  # (JAX: one numpy batch, no tf.data)
        assert text in done.stdout, done.stdout
    assert "skipped" not in done.stdout, done.stdout  # every mode ran, XLA included
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC


@pytest.mark.slow  # a fresh process
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "missing.keras"],
            "`--model` must be the path of an existing `.keras` file. "
            "Received: --model='missing.keras' (no such file)",
        ),
        (
            ["--repeats", "0"],
            "`--repeats` must be an integer >= 1 (timed rounds). Received: --repeats=0",
        ),
    ],
)
def test_cli_bad_argument_is_one_clean_error_with_status_2(tmp_path, argv, message):
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-m", "keras_fastgrad.profile", *argv],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr
    error_lines = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(error_lines) == 1, done.stderr
    assert error_lines[0].startswith(f"python -m keras_fastgrad.profile: error: {message}")
    assert done.stdout == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--warmup", "0"],
            "`--warmup` must be an integer >= 1 (untimed calls per function). Received: --warmup=0",
        ),
        (
            ["--batch-size", "-3"],
            "`--batch-size` must be an integer >= 1 (samples per profiled batch). Received: --batch-size=-3",
        ),
        (
            ["--modes", "xla,fast"],
            "`--modes` must be a comma-separated list of names from eager,function,xla,mixed_float16,mixed_bfloat16. Received: --modes='xla,fast' (unknown: fast)",
        ),
        (
            ["--model", "."],
            "`--model` must be the path of an existing `.keras` file. Received: --model='.' (a directory)",
        ),
    ],
)
def test_cli_other_bad_arguments_exit_2_before_loading_anything(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        profile_cli.parse_args(argv)
    assert info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_xla_mode_runs_adaptive_clipping():
    # The model is not compiled with `jit_compile=True`, but the profiler's
    # "xla" mode compiles its step: adaptive clipping must pick the norm
    # XLA has (`EuclideanNorm` has no XLA kernel) from the trace's context,
    # not from the model's flag.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs))
    model = keras_fastgrad.FastGradModel(inputs, outputs, clip_adaptive=0.01)
    model.compile(  # (JAX's "auto" would be True; TF's is False on a CPU)
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    assert not model.jit_compile
    modes = ("eager", "xla") if ON_JAX else ("function", "xla")
    result = keras_fastgrad.profile_step(
        model, batch(), modes=modes, repeats=2, warmup=1, verbose=0
    )
    assert set(result.phases) == set(modes), result.skipped
