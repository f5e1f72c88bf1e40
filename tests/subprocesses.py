"""Running a test's script in a fresh Python (a backend chosen, a module
blocked): one helper for the tests that need a process of their own. No
TensorFlow or JAX import here (the JAX tests and the blocked-import tests use it)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(script, env, cwd=ROOT, timeout=300):
    """Runs `script` with `python -c` under the environment `env` (the whole
    environment, not additions) from `cwd`; fails the test with the end of
    its stderr if it fails. Returns its stdout."""
    return _run(["-c", script], env, cwd, timeout)


def _run(args, env, cwd, timeout):
    """`python *args`; fails the test with the end of its stderr if it
    fails. Returns its stdout."""
    done = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def run_on_host_devices(module, devices, out_path, args=(), timeout=300):
    """Runs `python -m module OUT_PATH *args` under `KERAS_BACKEND=jax` with
    `devices` JAX host devices (`--xla_force_host_platform_device_count`,
    after the tests' own `XLA_FLAGS`: conftest.py's code generation level),
    the checkout first on the path; fails the test with the end of its
    stderr if it fails. Returns the JSON the module wrote to `out_path`."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        ),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    _run(["-m", module, str(out_path), *args], env, ROOT, timeout)
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)
