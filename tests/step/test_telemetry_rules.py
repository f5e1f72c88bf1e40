"""The telemetry counters' and the divergence streak's rules, called directly
(`keras_fastgrad.step.telemetry`, `keras_fastgrad.step.divergence`: the core
both backends' steps use), under either backend; then the TensorFlow shell's
writes into its variables (`tensorflow_only`).

References: a plain-Python replay of the documented contract (`_replay`:
counts add one where their event happened, the latest values are replaced,
an applied update resets the streak, a failed drop adds one), and values
worked out by hand beside each assertion. No expected value is taken from
the rules' own output.
"""

import math

import keras
import numpy as np
import pytest

from keras_fastgrad.step import divergence
from keras_fastgrad.step import telemetry as core

TF_ONLY = pytest.mark.tensorflow_only(reason="the TensorFlow shell's variables")


def _floats(counters):
    return {k: float(keras.ops.convert_to_numpy(v)) for k, v in counters._asdict().items()}


def _replay(events):
    """The counters after `events`, by the module docstring's contract."""
    c = {
        "grad_norm": 0.0,
        "clipped_updates": 0.0,
        "updates": 0.0,
        "nonfinite_count": 0.0,
        "nonfinite_first_index": -1.0,
        "nonfinite_num_variables": 0.0,
        "input_shape_changes": 0.0,
        "last_input_batch": -1.0,
        "last_input_size": -1.0,
    }
    for kind, happened, *args in events:
        if not happened:
            continue
        if kind == "drop":
            c["nonfinite_count"] += 1
            first, num = args
            if first is not None:
                c["nonfinite_first_index"], c["nonfinite_num_variables"] = first, num
        elif kind == "dropped_update":
            c["nonfinite_count"] += 1
            c["nonfinite_first_index"] = -1.0
        elif kind == "update":
            norm, clipped = args
            c["updates"] += 1
            if norm is not None:
                c["grad_norm"] = norm
            if clipped:
                c["clipped_updates"] += 1
        elif kind == "shape":
            rows, size = args
            if c["last_input_batch"] >= 0 and (
                rows != c["last_input_batch"] or size != c["last_input_size"]
            ):
                c["input_shape_changes"] += 1
            c["last_input_batch"], c["last_input_size"] = rows, size
    return c


def _rule(counters, kind, args):
    if kind == "drop":
        return core.dropped(*args)
    if kind == "dropped_update":
        return core.dropped_update()
    if kind == "update":
        norm, clipped = args
        return core.updated(norm, None if clipped is None else keras.ops.convert_to_tensor(clipped))
    rows, size = args
    return core.input_shape(counters.last_input_batch, counters.last_input_size, rows, size)


EVENTS = [
    ("shape", True, 8.0, 32.0),  # the first micro-batch: nothing before it
    ("drop", True, 3, 2),
    ("shape", True, 8.0, 32.0),  # the same shape
    ("update", False, 9.0, True),  # not applied: nothing changes
    ("update", True, 2.5, True),
    ("drop", True, None, None),  # counted, the location kept
    ("dropped_update", True),
    ("shape", True, 4.0, 16.0),  # fewer rows
    ("shape", True, 4.0, 20.0),  # same rows, another element count
    ("update", True, 1.5, False),
    ("update", True, None, None),  # norm not measured, no clipping
    ("drop", False, 7, 7),
]


@pytest.mark.parametrize("masked", [False, True], ids=["python_true", "boolean_tensor"])
def test_apply_follows_the_contract(masked):
    counters = core.INITIAL
    for kind, happened, *args in EVENTS:
        change = _rule(counters, kind, args)
        if masked:
            where = keras.ops.convert_to_tensor(happened)
        elif happened:
            where = True
        else:
            continue
        counters = core.apply(counters, change, where)
    assert _floats(counters) == _replay(EVENTS)


def test_replayed_by_hand():
    # 3 drops counted (the last did not happen); 3 updates, 1 clipped;
    # 2 shape changes (8->4 rows, 16->20 elements); the dropped update
    # set the location to -1 after the drop at index 3 (2 bad).
    expected = {
        "grad_norm": 1.5,
        "clipped_updates": 1.0,
        "updates": 3.0,
        "nonfinite_count": 3.0,
        "nonfinite_first_index": -1.0,
        "nonfinite_num_variables": 2.0,
        "input_shape_changes": 2.0,
        "last_input_batch": 4.0,
        "last_input_size": 20.0,
    }
    assert _replay(EVENTS) == expected


def test_logs_in_log_keys_order_only_the_wanted():
    counters = core.INITIAL._replace(updates=3.0, grad_norm=0.5)
    logs = core.logs(counters, 128.0, 6, optional=[("update_ratio", 0.01)])
    assert list(logs) == list(core.LOG_KEYS) + ["update_ratio"]
    values = {k: float(keras.ops.convert_to_numpy(v)) for k, v in logs.items()}
    assert values["updates"] == 3.0 and values["grad_norm"] == 0.5
    assert values["loss_scale"] == 128.0 and values["tape_variables"] == 6.0
    assert values["nonfinite_first_index"] == -1.0
    assert values["update_ratio"] == pytest.approx(0.01)
    some = core.logs(counters, 1.0, 6, keys={"tape_variables", "updates"}, optional=[("x", 1.0)])
    assert list(some) == ["updates", "tape_variables"]


def test_logs_end_with_the_noise_scales_keys_when_wanted():
    from keras_fastgrad.step import noise_scale

    # EMAs 2 and 4 with weight 0.5: |G|^2 = 4, tr(Sigma) = 8, B_simple = 2
    noise = noise_scale.Estimates(None, 2.0, 4.0, keras.ops.convert_to_tensor(0.5), 0.99)
    logs = core.logs(core.INITIAL, 1.0, 2, keys={"updates", "gns_simple"}, noise=noise)
    assert {k: float(keras.ops.convert_to_numpy(v)) for k, v in logs.items()} == {
        "updates": 0.0,
        "gns_simple": 2.0,
    }
    every = core.logs(core.INITIAL, 1.0, 2, noise=noise)
    assert list(every) == list(core.LOG_KEYS) + ["gns_simple", "gns_grad_sq", "gns_trace"]
    assert list(core.logs(core.INITIAL, 1.0, 2, keys={"updates"}, noise=noise)) == ["updates"]


def test_location_only_while_a_key_asks():
    nan, inf = float("nan"), float("inf")
    marks = keras.ops.convert_to_tensor([1.0, nan, inf, nan])  # the last entry: the loss

    def never():
        raise AssertionError("the marks are read only while a location key is asked")

    assert core.location({"updates", "nonfinite_count"}, never) == (None, None)
    first, num = core.location({"nonfinite_num_variables"}, lambda: marks)
    assert (int(first), int(num)) == (1, 2)  # the loss is not a gradient
    first, num = core.location({"nonfinite_first_index"}, marks, with_loss=False)
    assert (int(first), int(num)) == (1, 3)
    first, num = core.location({"nonfinite_first_index"}, lambda: None)  # no gradient
    assert (float(first), float(num)) == (-1.0, 0.0)


def test_an_update_measures_the_requested_keys():
    telemetry = core.StepTelemetry()
    telemetry.build(["d/kernel", "d/bias", "e/kernel"], ["grad_norm/d", core.UPDATE_RATIO])
    grads = [keras.ops.convert_to_tensor(v) for v in ([3.0], [4.0], [12.0])]
    before = [keras.ops.convert_to_tensor(v) for v in ([3.0, 4.0], [0.0], [0.0])]
    after = [keras.ops.convert_to_tensor(v) for v in ([3.0, 4.5], [0.0], [0.0])]

    def floats(out):
        return {k: round(float(keras.ops.convert_to_numpy(v)), 6) for k, v in out.items()}

    # grad_norm/d = |(3, 4)| = 5 (e not requested); ratio = 0.5 / |(3, 4)| = 0.1
    assert floats(telemetry.measure(grads, before, after, agc_fraction=0.5)) == {
        "grad_norm/d": 5.0,
        "update_ratio": 0.1,
    }
    assert floats(telemetry.measure(grads)) == {"grad_norm/d": 5.0}
    assert telemetry.measured_keys(clip_adaptive=None) == ["grad_norm/d", "update_ratio"]


def test_measures_after_an_update_branch():
    old = {"update_ratio": 0.5, "grad_norm/d": 1.0}
    new = {"update_ratio": 0.1, "grad_norm/d": 3.0}
    t, f = keras.ops.convert_to_tensor(True), keras.ops.convert_to_tensor(False)

    def values(entered, applied):
        out = core.measures_after(old, new, entered, applied)
        return {k: round(float(keras.ops.convert_to_numpy(v)), 6) for k, v in out.items()}

    # a dropped update (branch entered, nothing applied) keeps the old ratio
    assert values(t, f) == {"update_ratio": 0.5, "grad_norm/d": 3.0}
    assert values(t, t) == {"update_ratio": 0.1, "grad_norm/d": 3.0}
    assert values(f, f) == old


def test_variables_are_the_counters_in_file_order():
    telemetry = core.StepTelemetry()
    telemetry.build(["d/kernel", "d/bias", "e/kernel"], ["grad_norm/e", core.UPDATE_RATIO])
    assert [v.name for v in telemetry.variables] == list(core.Counters._fields)
    assert [k for k, _ in telemetry.optional_variables()] == ["grad_norm/e", "update_ratio"]
    assert _floats(telemetry.counters()) == _replay([])


def test_keys():
    assert core.layer_key("dense_1/kernel") == "grad_norm/dense_1"
    assert core.is_optional_key("grad_norm/dense_1") and core.is_optional_key("gns_simple")
    assert core.is_task_key("task_cosine/a/b") and not core.is_optional_key("updates")


def test_which_keys_switch_the_count_and_the_location_on():
    assert core.counts_nonfinite(True, set())  # a gated step always counts
    assert not core.counts_nonfinite(False, {"updates", "grad_norm"})
    for key in ("nonfinite_count", "nonfinite_first_index", "nonfinite_num_variables"):
        assert core.counts_nonfinite(False, {key})
    assert not core.locates_nonfinite({"nonfinite_count"})
    assert core.locates_nonfinite({"nonfinite_num_variables"})


@pytest.mark.parametrize(
    "finite, scale, expected",
    [(True, None, False), (False, None, True), (False, 2.0, False), (False, 1.0, True)],
)
def test_counts_as_failure(finite, scale, expected):
    assert (
        bool(divergence.counts_as_failure(keras.ops.convert_to_tensor(finite), scale)) is expected
    )


def test_streak():
    t, f = keras.ops.convert_to_tensor(True), keras.ops.convert_to_tensor(False)
    streak = 0.0
    streak = divergence.streak_after(streak, failed=True)  # 1
    streak = divergence.streak_after(streak, failed=t)  # 2
    streak = divergence.streak_after(streak, failed=f)  # 2 (a drop that is no failure)
    assert float(streak) == 2.0
    assert divergence.diverged(streak, 2) and not divergence.diverged(streak, 3)
    assert not divergence.diverged(streak, None)
    assert float(divergence.streak_after(streak, failed=False, applied=f)) == 2.0
    assert float(divergence.streak_after(streak, failed=False, applied=t)) == 0.0
    assert divergence.streak_after(streak, applied=True) == 0.0


def test_each_events_change_of_counters_and_streak():
    t, f = keras.ops.convert_to_tensor(True), keras.ops.convert_to_tensor(False)

    def after(events, streak=0.0):
        counters = core.INITIAL
        for change, where in events:
            counters, streak = core.apply_change(counters, streak, change, where)
        values = _floats(counters)
        return values["nonfinite_count"], values["updates"], float(streak)

    # (nonfinite_count, updates, streak), by hand
    assert after([(core.micro_batch_dropped(), True)]) == (1.0, 0.0, 1.0)
    assert after([(core.micro_batch_dropped(), f)]) == (0.0, 0.0, 0.0)  # not dropped
    # loss scaling: dropped, no failure (the scale still above 1)
    assert after([(core.micro_batch_dropped(failed=f), t)]) == (1.0, 0.0, 0.0)
    # skip_nonfinite=False: counted, never a failure
    assert after([(core.micro_batch_dropped(failed=t, gated=False), t)]) == (1.0, 0.0, 0.0)
    assert after([(core.update_dropped(), t)], streak=2.0) == (1.0, 0.0, 3.0)
    assert after([(core.update_applied(), t)], streak=2.0) == (0.0, 1.0, 0.0)
    assert after([(core.update_applied(), f)], streak=2.0) == (0.0, 0.0, 2.0)
    # counted at its verdict already: the streak only
    _, streak_only = core.counted_once(core.update_dropped())
    assert after([(streak_only, t)], streak=1.0) == (0.0, 0.0, 2.0)


def test_loss_result_is_nan_while_dropping():
    mean = keras.ops.convert_to_tensor(0.25)
    assert float(divergence.loss_result(mean, 0.0)) == 0.25
    assert math.isnan(float(divergence.loss_result(mean, 1.0)))


def test_training_loss():
    tracker = divergence.TrainingLoss()
    assert math.isnan(float(tracker.result()))  # nothing kept (Keras' Mean says 0.0)
    tracker.update_state(2.0, sample_weight=4.0)
    tracker.update_state(1.0, sample_weight=4.0)
    assert float(tracker.result()) == 1.5
    streak = keras.Variable(1.0, trainable=False)
    dropping = divergence.TrainingLoss(streak=lambda: streak)
    dropping.update_state(2.0)
    assert math.isnan(float(dropping.result()))


def _tensorflow_state(limit=None):
    import types

    from keras_fastgrad.backend.tensorflow.telemetry import StepTelemetry

    telemetry, watch = StepTelemetry(), divergence.DivergenceWatch(limit)
    telemetry.build()
    watch.build()
    return types.SimpleNamespace(telemetry=telemetry, divergence=watch)


@TF_ONLY
def test_tensorflow_shell_writes_the_rules():
    import tensorflow as tf

    from keras_fastgrad.backend.tensorflow.telemetry import record

    state = _tensorflow_state()
    t = state.telemetry
    t.record_input_shape(tf.zeros((8, 4)))
    record(state, core.micro_batch_dropped(tf.constant(3), tf.constant(2)))
    record(state, core.update_applied(tf.constant(2.5), tf.constant(True)))
    record(state, core.micro_batch_dropped())
    record(state, core.update_dropped())
    t.record_input_shape(tf.zeros((4, 4)))
    t.record_input_shape(tf.zeros((4, 5)))
    record(state, core.update_applied(tf.constant(1.5), tf.constant(False)))
    record(state, core.update_applied(None, None))
    events = [e for e in EVENTS if e[0] != "shape"] + [
        ("shape", True, 8.0, 32.0),
        ("shape", True, 4.0, 16.0),
        ("shape", True, 4.0, 20.0),
    ]
    assert _floats(t.counters()) == _replay(events)
    logs = t.logs(tf.constant(1.0), 5, keys={"updates", "nonfinite_count"})
    assert {k: float(v) for k, v in logs.items()} == {"updates": 3.0, "nonfinite_count": 3.0}


@TF_ONLY
def test_tensorflow_shell_streak():
    from keras_fastgrad.backend.tensorflow.telemetry import record

    state = _tensorflow_state(limit=2)
    watch = state.divergence

    def streak():
        return float(np.asarray(watch.streak.numpy()))

    record(state, core.micro_batch_dropped())
    record(state, core.micro_batch_dropped(failed=keras.ops.convert_to_tensor(False)))
    assert not watch.diverged()
    record(state, core.micro_batch_dropped(failed=keras.ops.convert_to_tensor(True)))
    assert watch.diverged()
    record(state, core.micro_batch_dropped(gated=False))  # counted, no failure
    assert streak() == 2.0
    record(state, core.update_applied())
    assert not watch.diverged() and streak() == 0.0
    counters_only, streak_only = core.counted_once(core.update_dropped())
    record(state, counters_only)
    assert streak() == 0.0
    record(state, streak_only)
    assert streak() == 1.0
    assert float(state.telemetry.nonfinite_count.numpy()) == 5.0  # 4 drops, 1 update
