"""Running a test's script in a fresh Python (a backend chosen, a module
blocked): one helper for the tests that need a process of their own. No
TensorFlow or JAX import here (the JAX tests and the blocked-import tests use it)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(script, env, cwd=ROOT, timeout=300):
    """Runs `script` with `python -c` under the environment `env` (the whole
    environment, not additions) from `cwd`; fails the test with the end of
    its stderr if it fails. Returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
