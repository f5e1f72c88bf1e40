"""Every bad argument gets an error naming the argument, the rule and the
value received."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import data, fast, max_weight_diff, mlp


@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            0,
            ValueError,
            r"`accumulation_steps` must be an integer >= 1.*Received: accumulation_steps=0",
        ),
        (
            -2,
            ValueError,
            r"`accumulation_steps` must be an integer >= 1.*Received: accumulation_steps=-2",
        ),
        (
            1.5,
            TypeError,
            r"`accumulation_steps` must be an integer >= 1.*accumulation_steps=1.5 of type float",
        ),
        (
            "2",
            TypeError,
            r"`accumulation_steps` must be an integer.*accumulation_steps='2' of type str",
        ),
        (True, TypeError, r"`accumulation_steps` must be an integer.*accumulation_steps=True"),
    ],
)
def test_bad_accumulation_steps(value, error, match):
    with pytest.raises(error, match=match):
        fast(accumulation_steps=value)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"`clip_norm` must be a finite number > 0 or None.*Received: clip_norm=0"),
        (-1.0, ValueError, r"`clip_norm` must be a finite number > 0.*clip_norm=-1.0"),
        (float("inf"), ValueError, r"`clip_norm` must be a finite number > 0.*clip_norm=inf"),
        ("1.0", TypeError, r"`clip_norm` must be a number > 0.*clip_norm='1.0' of type str"),
    ],
)
def test_bad_clip_norm(value, error, match):
    with pytest.raises(error, match=match):
        fast(clip_norm=value)


def test_unknown_multitask_lists_the_valid_names():
    with pytest.raises(
        ValueError,
        match=r"`multitask` must be None or one of \[.*'pcgrad'.*\]\. Received: multitask='pcgard'",
    ):
        fast(multitask="pcgard")


@pytest.mark.parametrize("name", ["skip_nonfinite", "telemetry"])
def test_bool_options_reject_non_bools(name):
    with pytest.raises(TypeError, match=rf"`{name}` must be a boolean.*{name}=1 of type int"):
        fast(**{name: 1})


@pytest.mark.parametrize("name", ["skip_nonfinite", "telemetry"])
@pytest.mark.parametrize(
    "value, expected", [(np.True_, True), (np.False_, False), (np.bool_(1), True)]
)
def test_bool_options_accept_numpy_bools_as_python_bools(name, value, expected):
    model = fast(**{name: value})
    stored = getattr(model, name)
    assert type(stored) is bool and stored is expected


def test_accumulation_owned_twice_is_refused():
    model = fast(accumulation_steps=4)
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=4)
    with pytest.raises(
        ValueError,
        match=r"accumulation_steps=4.*gradient_accumulation_steps=4.*Fix: remove `gradient_accumulation_steps`",
    ):
        model.compile(optimizer=optimizer, loss="mse")


@pytest.mark.parametrize("attr", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_owned_twice_is_refused(attr):
    model = fast(clip_norm=1.0)
    optimizer = keras.optimizers.SGD(**{attr: 2.0})
    with pytest.raises(ValueError, match=rf"clip_norm=1.0.*`{attr}=2.0`.*Fix: remove `{attr}`"):
        model.compile(optimizer=optimizer, loss="mse")


def test_clipping_owned_twice_is_refused_under_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = fast(clip_norm=1.0)
    with pytest.raises(ValueError, match=r"`global_clipnorm=2.0`"):
        model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=2.0), loss="mse")


@pytest.mark.parametrize(
    "owner",
    [
        {"global_clipnorm": 1.0},
        {"clipnorm": 0.5},
        {"gradient_accumulation_steps": 2},
    ],
)
def test_optimizer_options_alone_stay_allowed(owner):
    # One owner is fine: the optimizer clips or accumulates (and the model
    # does not), and the model then trains exactly as keras.Model with that
    # optimizer: clipped or accumulated once, by the optimizer.
    x, y = data(n=8)
    y = y * 50.0  # gradients far above the clip norms
    ref, model = mlp(), fast()
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1, **owner), loss="mse")
        m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(model, ref) < 1e-6
    assert max_weight_diff(plain, ref) > 1e-2  # the optimizer's option acted


def test_unknown_telemetry_key_is_refused():
    with pytest.raises(
        ValueError, match=r"`keys` must be names from .*Received unknown names: \['grad_nrom'\]"
    ):
        fast().enable_telemetry(["grad_nrom"])


def test_xla_under_multi_worker_on_cpu_is_refused_clearly():
    # Measured: MultiWorkerMirroredStrategy on CPU with jit_compile=True fails
    # in TF ("Collectives are not yet implemented for CPU devices when
    # compiling with XLA") and the worker process crashes. The check runs on
    # a stand-in with that strategy's device list (no second process needed).
    from types import SimpleNamespace

    from keras_fastgrad.step.trainer import check_jit_compile_under_strategy

    class MultiWorkerMirroredStrategy(SimpleNamespace):
        pass

    strategy = MultiWorkerMirroredStrategy(
        num_replicas_in_sync=2,
        extended=SimpleNamespace(worker_devices=("/job:worker/replica:0/task:0/device:CPU:0",)),
    )
    with pytest.raises(
        ValueError,
        match=r"`jit_compile=True` is not supported by TensorFlow under `MultiWorkerMirroredStrategy` on CPU devices.*Fix: compile with `jit_compile=False`",
    ):
        check_jit_compile_under_strategy(True, strategy)
    gpu = MultiWorkerMirroredStrategy(
        num_replicas_in_sync=2,
        extended=SimpleNamespace(worker_devices=("/job:worker/replica:0/task:0/device:GPU:0",)),
    )
    check_jit_compile_under_strategy(True, gpu)  # allowed: TF has GPU collectives
    check_jit_compile_under_strategy(False, strategy)


# ------------------------------------------- construction refuses bad names
_TYPO = r"`accumulation_step` is not an argument of `{}`.*Received: accumulation_step=2\. Fix: did you mean `accumulation_steps`\?"


class _Subclassed(keras_fastgrad.FastGradModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(x)


def test_a_misspelt_option_is_refused_with_the_closest_name():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    with pytest.raises(TypeError, match=_TYPO.format("FastGradModel")):
        keras_fastgrad.FastGradModel(inputs, outputs, accumulation_step=2)
    with pytest.raises(TypeError, match=_TYPO.format("FastGradModel")):
        keras_fastgrad.FastGradModel(inputs=inputs, outputs=outputs, accumulation_step=2)
    with pytest.raises(TypeError, match=_TYPO.format("FastGradSequential")):
        keras_fastgrad.FastGradSequential([inputs, keras.layers.Dense(1)], accumulation_step=2)
    with pytest.raises(TypeError, match=_TYPO.format("_Subclassed")):
        _Subclassed(accumulation_step=2)
    with pytest.raises(
        TypeError,
        match=r"unknown option\(s\) \['accumulation_step'\].*Fix: did you mean `accumulation_steps`\?",
    ):
        keras_fastgrad.fastgrad(keras.Model(inputs, outputs), accumulation_step=2)
    with pytest.raises(TypeError, match=r"`nmae` is not an argument.*Fix: did you mean `name`\?"):
        keras_fastgrad.FastGradModel(inputs, outputs, nmae="m")


def test_keras_own_keywords_stay_accepted():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras_fastgrad.FastGradModel(inputs=inputs, outputs=outputs, name="m", trainable=False)
    assert (model.name, model.trainable) == ("m", False)
    model = _Subclassed(name="s", dtype="float64", trainable=True, accumulation_steps=2)
    assert (model.name, model.dtype_policy.name, model.accumulation_steps) == ("s", "float64", 2)
    assert keras_fastgrad.FastGradSequential([inputs, keras.layers.Dense(1)], name="q").name == "q"


@pytest.mark.parametrize(
    "make",
    [
        lambda **o: fast(**o),
        lambda **o: _Subclassed(**o),
        lambda **o: keras_fastgrad.FastGradSequential(
            [keras.Input((3,)), keras.layers.Dense(1)], **o
        ),
        lambda **o: keras_fastgrad.fastgrad(mlp(keras.Model), **o),
    ],
    ids=["functional", "subclassed", "sequential", "fastgrad"],
)
@pytest.mark.parametrize("features", ["", "  "])
def test_an_empty_multitask_features_is_refused_at_construction(make, features):
    with pytest.raises(
        ValueError,
        match=rf"`multitask_features` must be None or a layer name \(a non-empty string\)\. Received: multitask_features={features!r}\. Fix:",
    ):
        make(multitask="pcgrad", multitask_space="features", multitask_features=features)


@pytest.mark.parametrize(
    "options",
    [
        {
            "accumulation_steps": 3,
            "clip_norm": 2.0,
            "clip_adaptive": 0.05,
            "clip_adaptive_eps": 0.01,
            "skip_nonfinite": False,
            "telemetry": True,
            "micro_batches": 2,
            "max_consecutive_nonfinite": None,
        },
        {
            "multitask": "mgda",
            "multitask_space": "features",
            "multitask_features": "hidden",
            "max_consecutive_nonfinite": 4,
        },
    ],
)
def test_every_option_given_reaches_the_model(options):
    # `__init__` reads each option by name: none may be dropped on the way.
    stored = fast(**options).get_config()
    for name, value in options.items():
        assert (
            stored[name] if name != "multitask" else stored[name]["class_name"].lower()
        ) == value, name


# ------------------------------------------------- adaptive gradient clipping
@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            0,
            ValueError,
            r"`clip_adaptive` must be a finite number > 0.*Received: clip_adaptive=0\. Fix",
        ),
        (-0.01, ValueError, r"`clip_adaptive` must be.*or None.*clip_adaptive=-0.01"),
        (float("inf"), ValueError, r"`clip_adaptive` must be a finite number.*clip_adaptive=inf"),
        (float("nan"), ValueError, r"`clip_adaptive` must be a finite number.*clip_adaptive=nan"),
        ("0.01", TypeError, r"`clip_adaptive` must be.*clip_adaptive='0.01' of type str"),
        (True, TypeError, r"`clip_adaptive` must be.*clip_adaptive=True of type bool"),
    ],
)
def test_bad_clip_adaptive(value, error, match):
    with pytest.raises(error, match=match):
        fast(clip_adaptive=value)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            0.0,
            ValueError,
            r"`clip_adaptive_eps` must be a finite number > 0.*clip_adaptive_eps=0.0",
        ),
        (-1e-3, ValueError, r"`clip_adaptive_eps` must be.*clip_adaptive_eps=-0.001"),
        (float("inf"), ValueError, r"`clip_adaptive_eps` must be.*clip_adaptive_eps=inf"),
        (None, TypeError, r"`clip_adaptive_eps` must be.*clip_adaptive_eps=None of type NoneType"),
    ],
)
def test_bad_clip_adaptive_eps(value, error, match):
    with pytest.raises(error, match=match):
        fast(clip_adaptive=0.01, clip_adaptive_eps=value)


def test_clip_adaptive_eps_without_clip_adaptive_is_refused():
    with pytest.raises(
        ValueError,
        match=r"`clip_adaptive_eps` is used only by adaptive gradient clipping.*"
        r"Received: clip_adaptive=None, clip_adaptive_eps=0.01\. Fix: pass `clip_adaptive=",
    ):
        fast(clip_adaptive_eps=0.01)


def test_clip_adaptive_whose_smallest_bound_is_not_a_float32_is_refused():
    # 1e-30 * 1e-10 = 1e-40 is subnormal in float32 (flushed to 0 on CPU).
    with pytest.raises(
        ValueError,
        match=r"`clip_adaptive \* clip_adaptive_eps`.*normal float32.*"
        r"Received: clip_adaptive=1e-30, clip_adaptive_eps=1e-10\. Fix",
    ):
        fast(clip_adaptive=1e-30, clip_adaptive_eps=1e-10)
    assert fast(clip_adaptive=1e-30, clip_adaptive_eps=1e-3).clip_adaptive == 1e-30


def test_clip_adaptive_options_reach_every_constructor():
    layers = [keras.Input((3,)), keras.layers.Dense(1)]
    for model in (
        fast(clip_adaptive=0.02, clip_adaptive_eps=1e-2),
        keras_fastgrad.FastGradSequential(layers, clip_adaptive=0.02, clip_adaptive_eps=1e-2),
        keras_fastgrad.fastgrad(mlp(), clip_adaptive=0.02, clip_adaptive_eps=1e-2),
    ):
        assert (model.clip_adaptive, model.clip_adaptive_eps) == (0.02, 1e-2)
    assert (fast().clip_adaptive, fast().clip_adaptive_eps) == (None, 1e-3)  # the paper's eps
    with pytest.raises(ValueError, match=r"`clip_adaptive` must be a finite number > 0"):
        keras_fastgrad.fastgrad(mlp(), clip_adaptive=-1)


# ------------------------------------- the options as the step reads them
def test_the_step_reads_the_options_every_constructor_was_given():
    # `StepOptions` (`state.options`) is what the step's units read: it
    # must hold what the user gave, however the model was made or loaded.
    from keras_fastgrad.models.model import OPTION_NAMES
    from keras_fastgrad.step.options import NAMES

    assert set(NAMES) == set(OPTION_NAMES)
    given = {
        "accumulation_steps": 3,
        "clip_norm": 2.0,
        "clip_adaptive": 0.05,
        "clip_adaptive_eps": 0.01,
        "skip_nonfinite": False,
        "micro_batches": 2,
        "max_consecutive_nonfinite": None,
        "batchnorm_statistics": "micro_batch",
    }
    layers = [keras.Input((3,)), keras.layers.Dense(1)]
    made = fast(**given)
    for model in (
        made,
        keras_fastgrad.FastGradSequential(layers, **given),
        keras_fastgrad.fastgrad(mlp(), **given),
        type(made).from_config(made.get_config()),
        keras.models.clone_model(made),
    ):
        options = model.fastgrad_step_state.options
        assert {name: getattr(options, name) for name in given} == given, type(model)
        assert options.multitask is None and options.keras_metrics


def test_the_step_knows_a_class_with_its_own_metrics():
    class OwnMetrics(keras_fastgrad.FastGradModel):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            return super().compute_metrics(x, y, y_pred, sample_weight)

    inputs = keras.Input((3,))
    model = OwnMetrics(inputs, keras.layers.Dense(1)(inputs))
    assert not model.fastgrad_step_state.options.keras_metrics
