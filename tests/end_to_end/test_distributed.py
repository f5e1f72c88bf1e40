"""FastGradModel under tf.distribute gives the single-device result.

Logical devices must be configured before TensorFlow initialises, so the
MirroredStrategy cases run in a subprocess (distributed_cases.py) and the
MultiWorkerMirroredStrategy test starts two worker processes on 127.0.0.1.
The reference is always the single-device run on the same global batches.
"""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import needs_multi_replica_keras

pytestmark = [
    needs_multi_replica_keras,
    pytest.mark.slow,  # fresh processes
    pytest.mark.tensorflow_only(reason="tf.distribute strategies"),
]

# the scripts below run as modules of the `tests` package from the repo root
# (`python -m tests.distributed_cases`, `python -m tests.multiworker_worker`)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)


def _env(**extra):
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3", **extra)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrored") / "cases.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed_cases", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _Cases(json.loads(out.read_text()))


class _Cases(dict):
    """The cases' results; a case that crashed fails its own tests, with
    its traceback."""

    def __getitem__(self, name):
        result = super().__getitem__(name)
        assert "crashed" not in result, f"case {name!r}: {result.get('trace')}"
        return result


def _assert_same_as_single_device(result, tolerance=1e-5):
    assert result["max_weight_diff"] < tolerance
    assert result["replicas_agree"] == 0.0


def test_default_options_match_single_device_with_uneven_replica_split(mirrored):
    # 11 samples, global batch 4: the last batch of 3 splits 2/1.
    result = mirrored["default"]
    _assert_same_as_single_device(result)
    # Logged loss and metrics are global (not a mean of per-replica means).
    for key in ("loss", "mae", "grad_norm"):
        np.testing.assert_allclose(
            result["history"][key], result["reference_history"][key], rtol=1e-5
        )


def test_accumulation_and_clipping_clip_the_global_gradient(mirrored):
    result = mirrored["accumulation_and_clipping"]
    _assert_same_as_single_device(result)
    assert result["history"]["clipped_updates"][-1] > 0  # clipping acted
    assert result["history"]["clipped_updates"] == result["reference_history"]["clipped_updates"]
    np.testing.assert_allclose(
        result["history"]["grad_norm"], result["reference_history"]["grad_norm"], rtol=1e-5
    )


def test_micro_batches_with_accumulation_match_single_device(mirrored):
    _assert_same_as_single_device(mirrored["micro_batches"])


@pytest.mark.parametrize("synchronized", [False, True])
def test_batchnorm_statistics_pooled_over_replicas_equal_keras_on_one_device(
    mirrored, synchronized
):
    # Keras on one device on the concatenated window: what `synchronized=True`
    # computes across replicas for one batch.
    result = mirrored["batchnorm_window"][f"synchronized={synchronized}"]
    assert result["moved"] > 0.01  # the reference's statistics did move
    assert result["mean_diff"] < 1e-6
    assert result["variance_diff"] < 1e-5
    assert result["replicas_agree"] == 0.0


def test_masked_sequences_weighted_by_valid_steps_across_replicas(mirrored):
    # Replica 0 holds rows with 1 valid step, replica 1 rows with 6; with
    # windows of 2: the same as keras.Model on batches of 16.
    _assert_same_as_single_device(mirrored["masked_sequences"])


def test_window_whose_global_normaliser_is_zero_steps_like_keras(mirrored):
    # Reference: keras.Model on the big batch (one device).
    result = mirrored["zero_normaliser"]
    assert result["iterations"] == 4
    _assert_same_as_single_device(result)


def test_replica_sum_that_overflows_never_reaches_the_weights(mirrored):
    result = mirrored["replica_sum_overflow"]
    assert result["weights"] == [1.0]  # dropped, then a tiny finite update
    assert result["history"]["nonfinite_count"] == [1.0]
    assert result["history"]["updates"] == [1.0]


def test_nan_on_one_replica_is_dropped_on_every_replica(mirrored):
    # Reference: single device trained without that global batch.
    result = mirrored["nan_on_one_replica"]
    _assert_same_as_single_device(result)
    assert result["history"]["nonfinite_count"] == [1.0]
    np.testing.assert_allclose(
        result["history"]["mae"], result["reference_history"]["mae"], rtol=1e-5
    )


def test_per_output_losses_leave_out_a_batch_dropped_on_one_replica(mirrored):
    # Reference: keras.Model on one device trained without that global batch.
    result = mirrored["per_output_losses_nan_on_one_replica"]
    _assert_same_as_single_device(result)
    assert result["history"]["nonfinite_count"] == [1.0]
    for key in ("a_loss", "b_loss", "loss"):
        np.testing.assert_allclose(
            result["history"][key], result["reference_history"][key], rtol=1e-5, err_msg=key
        )


def test_mixed_float16_overflow_on_one_replica(mirrored):
    result = mirrored["mixed_float16_overflow_on_one_replica"]
    # float16 forward on half batches vs full batches: rounding only.
    assert result["max_weight_diff"] < 1e-3
    assert result["replicas_agree"] == 0.0
    assert result["history"]["nonfinite_count"] == [1.0]
    assert result["history"]["loss_scale"] == [2.0**7]  # 2**8 halved once


def test_steps_per_execution_under_mirrored_strategy_gives_a_clear_error(mirrored):
    # Keras' multi-step loop fails under MirroredStrategy (plain keras.Model
    # too): a clear error up front instead of a placeholder error deep in TF.
    result = mirrored["steps_per_execution"]
    assert not result["ok"]
    assert "`steps_per_execution` must be 1 under `MirroredStrategy`" in result["error"]


def test_keras_global_clipnorm_clips_per_replica_ours_globally(mirrored):
    result = mirrored["keras_global_clipnorm"]
    assert result["ours"] < 1e-6
    assert result["keras"] > 1e-3  # Keras' figure, for the README


def test_jit_compile_under_mirrored_strategy_gives_a_clear_error(mirrored):
    result = mirrored["jit_compile"]
    assert not result["ok"]
    assert (
        "`jit_compile=True` is not supported by TensorFlow under `MirroredStrategy`"
        in result["error"]
    )
    assert "Fix: compile with `jit_compile=False`" in result["error"]


# --------------------- the MirroredStrategy cases of a feature's own module
def test_adaptive_clipping_clips_the_global_gradient(mirrored):
    # mirrored_adaptive_clipping.py: AGC of the all-reduced gradient (numpy
    # reference), not of each replica's.
    for name, result in mirrored["adaptive_clipping"].items():
        assert result["n_clipped"] > 0, name
        assert result["updates"] == 1, name
        assert result["max_diff"] < 1e-5, name


def test_noise_scale_each_replica_is_a_small_batch(mirrored):
    # step/gns_mirrored.py: the replicas' halves are the small batches.
    results = mirrored["noise_scale"]
    assert set(results) == {"replicas", "plain_keras_model", "replicas_and_accumulation"}
    for name, result in results.items():
        assert result["step"] == pytest.approx(result["reference"], rel=2e-3), name


def test_multitask_merger_merges_the_global_task_gradients(mirrored):
    # A per-replica merge (each replica merging its own half-batch
    # gradients) would differ from the single-device run whenever the tasks
    # conflict (multitask/test_merger.py's model, PCGrad).
    for case in mirrored["multitask_merger_pcgrad"].values():
        assert case["first_batch_conflicts"]
        assert case["max_weight_diff"] < 1e-5
        np.testing.assert_allclose(case["norm_a"][0], case["norm_a"][1], rtol=1e-5)


def test_multitask_features_space_uses_the_global_gram(mirrored):
    # Per-replica Gram matrices (each replica weighting its own half batch)
    # would differ from one device (multitask/test_feature_space.py, MGDA).
    for case in mirrored["multitask_features_mgda"].values():
        assert case["max_weight_diff"] < 1e-5
        np.testing.assert_allclose(case["norm_a"][0], case["norm_a"][1], rtol=1e-5)


def test_training_only_layer_trains_like_keras_model(mirrored):
    # models/test_keras_hooks.py's auxiliary head, used only in training.
    for name, result in mirrored["training_only_layer"].items():
        assert result["trainable_variables"] == 6, name
        assert result["max_weight_diff"] < 1e-6, name


def test_synchronized_batchnorm_with_micro_batches_is_refused(mirrored):
    results = mirrored["synchronized_batchnorm_micro_batches"]
    refused = results["refused"]
    assert refused["type"] == "ValueError", refused  # not TensorFlow's RuntimeError
    for part in (
        "`micro_batches` cannot run the BatchNormalization layer `sync_bn`",
        "`synchronized=True` under `MirroredStrategy`",
        "Received: micro_batches=2, synchronized=True",
        "`BatchNormalization(synchronized=False)`",
        "`accumulation_steps=2`",
    ):
        assert part in refused["error"]
    # Both fixes the message names do train.
    assert results["accumulation"]["ok"], results["accumulation"]
    assert results["unsynchronized"]["ok"], results["unsynchronized"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_worker_mirrored_two_processes_match_single_device(tmp_path):
    from tests import multiworker_worker as worker

    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    procs, outputs = [], []
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        out = tmp_path / f"worker{index}.npz"
        outputs.append(out)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.multiworker_worker", str(out)],
                env=_env(TF_CONFIG=tf_config),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    weights = []
    for out in outputs:
        with np.load(out) as f:
            weights.append([f[k] for k in f.files])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)  # both workers identical

    x, y = worker.training_data()
    from tests.helpers import fast

    reference = fast(**worker.OPTIONS)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = reference.fit(x, y, **worker.FIT)
    for a, b in zip(weights[0], reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with open(f"{outputs[0]}.json") as f:
        worker_history = json.load(f)
    assert worker_history["clipped_updates"][-1] > 0
    np.testing.assert_allclose(worker_history["loss"], history.history["loss"], rtol=1e-5)
