"""Two JAX processes (`keras.distribution.initialize`, JAX's CPU collectives,
2 host devices each) train a `FastGradModel` under `DataParallel` and
`ModelParallel` as a plain `keras.Model` trains on one device (the
equivalent big batch, `Adam(global_clipnorm=)`, the rows of a window's
NaN micro-batch left out); a NaN in one process's rows drops that
micro-batch in both; a `.keras` file process 0 saves mid-window finishes
its window on two processes, on one, and on TensorFlow as uninterrupted
training does.

Both processes run tests/multiprocess_jax_worker.py once for the module
(~30 s on 2 idle cores); the references are computed here, in one
process on one device."""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests import multiprocess_jax_worker as worker
from tests.helpers import ROOT, run_on_tensorflow

TOL = 1e-5
# By hand: updates, non-finite micro-batches (tests/multiprocess_jax_worker.py's
# CASES: windows and NaN rows).
EXPECTED_COUNTS = {
    "data_parallel_mlp": (4.0, 2.0),
    "data_parallel_attention": (2.0, 0.0),
    "model_parallel_mlp": (2.0, 1.0),
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out, timeout=400):
    """Both workers, on a free port; fails with the end of both logs if one
    fails (the other is then ended: it would wait for its peer) or they run
    past `timeout` seconds."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        # (after the tests' own flags: conftest.py's code generation level)
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    port = _free_port()
    logs = [out / f"p{i}.log" for i in range(2)]
    workers = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            command = [sys.executable, "-m", "tests.multiprocess_jax_worker", str(i), str(port)]
            workers.append(
                subprocess.Popen([*command, str(out)], env=env, cwd=ROOT, stdout=f, stderr=f)
            )
    deadline = time.monotonic() + timeout
    while any(w.poll() is None for w in workers):
        failed = any(w.returncode not in (None, 0) for w in workers)
        if failed or time.monotonic() > deadline:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            break
        time.sleep(0.2)
    codes = [w.returncode for w in workers]
    tails = "\n".join(f"--- process {i}:\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
    assert codes == [0, 0], f"exit codes {codes} (timeout {timeout} s):\n{tails}"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    _run_workers(out)
    return out


def _weights(out, name, process_id):
    with np.load(out / f"{name}.p{process_id}.npz") as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _report(out, process_id):
    return json.loads((out / f"p{process_id}.json").read_text())


def _assert_close(weights, reference, tol=TOL):
    assert len(weights) == len(reference.weights)
    for w, r in zip(weights, reference.get_weights(), strict=True):
        np.testing.assert_allclose(w, r, rtol=0, atol=tol)


def _plain(kind, windows, x, y, epochs=1):
    """A plain `keras.Model` on one device, `Adam(global_clipnorm=CLIP)`, one
    big batch (rows) a window."""
    model = worker.build(kind, keras.Model)
    model.compile(keras.optimizers.Adam(1e-2, global_clipnorm=worker.CLIP), model.loss)
    for _ in range(epochs):
        for rows in windows:
            model.train_on_batch(x[rows], y[rows])
    return model


def _reference(case):
    """The case's windows (`accumulation_steps` global batches of 16, the
    last partial) without the rows of the batch that holds the NaN."""
    kind, rows, options, epochs, nan_row, _ = worker.CASES[case]
    x, y = worker.data(kind, rows)
    batches = [np.arange(s, min(s + 16, rows)) for s in range(0, rows, 16)]
    batches = [b[:0] if nan_row in b else b for b in batches]  # dropped, its slot kept
    steps = options["accumulation_steps"]
    windows = [np.concatenate(batches[s : s + steps]) for s in range(0, len(batches), steps)]
    return _plain(kind, windows, x, y, epochs)


@pytest.mark.parametrize("case", sorted(EXPECTED_COUNTS))
def test_two_processes_equal_one_device(out, case):
    _, rows, _, _, nan_row, parallel = worker.CASES[case]
    if nan_row is not None:  # the NaN is in one process's rows only
        owner = [i for i in range(2) if nan_row in worker.local_rows(rows, i)]
        assert owner == [1 if case.startswith("data") else 0]
    reports = [_report(out, i)[case] for i in range(2)]
    first, second = (_weights(out, case, i) for i in range(2))
    for a, b in zip(first, second, strict=True):  # both processes hold the same model
        np.testing.assert_array_equal(a, b)
    assert reports[0]["counters"] == reports[1]["counters"]
    counters = reports[0]["counters"]
    assert (counters["updates"], counters["nonfinite_count"]) == EXPECTED_COUNTS[case]
    assert reports[0]["kernel_devices"] == 4
    expected_spec = "(None, 'model')" if parallel == "model" else "(None, None)"
    assert reports[0]["kernel_spec"] == expected_spec
    assert reports[0]["window_sum_spec"] == expected_spec  # the window's sum, laid out alike
    _assert_close(first, _reference(case))


def _uninterrupted():
    """The resumed window's reference: one update on its 64 rows."""
    x, y = worker.data("mlp", worker.RESUME_ROWS)
    return _plain("mlp", [np.arange(worker.RESUME_ROWS)], x, y)


def test_a_file_saved_mid_window_resumes_on_two_processes(out):
    reports = [_report(out, i)["resume"] for i in range(2)]
    assert [r["pending"] for r in reports] == [2, 2]  # 2 of the window's 4 micro-batches
    assert [r["counters"]["updates"] for r in reports] == [1.0, 1.0]
    reference = _uninterrupted()
    for i in range(2):
        _assert_close(_weights(out, "resumed", i), reference)
        _assert_close(_weights(out, "uninterrupted", i), reference)


def test_a_file_saved_mid_window_by_two_processes_resumes_on_one(out):
    x, y = worker.data("mlp", worker.RESUME_ROWS)
    loaded = keras.saving.load_model(out / "mid.keras")
    for start in (32, 48):  # the window's last two global batches
        loaded.train_on_batch(x[start : start + 16], y[start : start + 16])
    assert loaded.telemetry_counters()["updates"] == 1.0
    _assert_close(loaded.get_weights(), _uninterrupted())


_RESUME_ON_TF = """
import sys, numpy as np, keras
import keras_fastgrad  # (registers FastGradModel)
sys.path.insert(0, {root!r})
from tests import multiprocess_jax_worker as worker
x, y = worker.data("mlp", worker.RESUME_ROWS)
loaded = keras.saving.load_model({path!r})
assert int(loaded.fastgrad_step_state.accumulator.micro_step.numpy()) == 2
for start in (32, 48):
    loaded.train_on_batch(x[start : start + 16], y[start : start + 16])
assert loaded.telemetry_counters()["updates"] == 1.0
np.savez({path!r} + ".tf.npz", *loaded.get_weights())
"""


@pytest.mark.needs_tensorflow(reason="the file resumes in a TensorFlow process")
def test_a_file_saved_mid_window_by_two_processes_resumes_on_tensorflow(out):
    path = str(out / "mid.keras")
    run_on_tensorflow(_RESUME_ON_TF.format(root=ROOT, path=path))
    with np.load(path + ".tf.npz") as f:
        weights = [f[f"arr_{i}"] for i in range(len(f.files))]
    _assert_close(weights, _uninterrupted())
