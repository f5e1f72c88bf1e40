"""Keras' own tests with the swap: is `FastGradModel` a drop-in?

Runs test files of the installed Keras (they ship with the wheel) twice,
with plain Keras and with `keras.Model` rebound to `FastGradModel` (and,
with `--sequential`, `keras.Sequential` to `FastGradSequential`; see
`tools/keras_swap_plugin.py`), and compares test by test. A test that
passes with Keras and fails with the swap must be listed in
`KNOWN_DIFFERENCES` with its reason (docs/how-to/bring-your-own-model.md, "Documented
differences"); any other such test makes the exit status 1.

    python tools/keras_suite.py                 # the default files
    python tools/keras_suite.py --sequential models/sequential_test.py
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import keras

DEFAULT_FILES = (
    "models/model_test.py",
    "models/functional_test.py",
    "models/sequential_test.py",
    "saving/saving_lib_test.py",
    "saving/saving_api_test.py",
    "callbacks/callback_test.py",
    "callbacks/early_stopping_test.py",
    "callbacks/model_checkpoint_test.py",
    "callbacks/terminate_on_nan_test.py",
    "callbacks/csv_logger_test.py",
    "callbacks/reduce_lr_on_plateau_test.py",
    "callbacks/learning_rate_scheduler_test.py",
    "callbacks/backup_and_restore_test.py",
)

# test id ("file::Class::test") -> why it differs with the swap. Each one
# is a documented difference (docs/how-to/bring-your-own-model.md, "Documented differences").
KNOWN_DIFFERENCES = {
    "models/functional_test/FunctionalTest::test_basic_flow_multi_input": (
        "the test builds `Functional(inputs, outputs)` directly and checks "
        "`isinstance(model, Model)`: with `Model` rebound, a plain "
        "`Functional` is not a `FastGradModel` (an artifact of the swap, "
        "not a behaviour difference)"
    ),
}

HERE = os.path.dirname(os.path.abspath(__file__))


def keras_src():
    return os.path.join(os.path.dirname(keras.__file__), "src")


def run(files, swap, sequential, out_dir):
    """Runs the files in one pytest process; returns {test id: outcome}."""
    tag = "swap" if swap else "keras"
    junit = os.path.join(out_dir, f"{tag}.xml")
    ini = os.path.join(out_dir, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    if sequential:
        env["KERAS_SWAP_SEQUENTIAL"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-c",
        ini,
        "--rootdir",
        keras_src(),
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-W",
        "ignore",
    ]
    if swap:
        cmd += ["-p", "keras_swap_plugin"]
    cmd += [os.path.join(keras_src(), f) for f in files]
    start = time.time()
    subprocess.run(cmd, env=env, cwd=out_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.time() - start
    return outcomes(junit), seconds


def outcomes(junit):
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        results[name] = outcome
    return results


def short(test_id):
    """`keras/src/models/model_test/ModelTest::test_x` -> a shorter id."""
    return test_id.split("keras/src/", 1)[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "files", nargs="*", default=list(DEFAULT_FILES), help="test files relative to keras/src"
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="also swap keras.Sequential for FastGradSequential",
    )
    args = parser.parse_args(argv)
    missing = [f for f in args.files if not os.path.exists(os.path.join(keras_src(), f))]
    if missing:
        parser.error(f"not in the installed Keras ({keras.__version__}): {missing}")
    with tempfile.TemporaryDirectory() as out_dir:
        plain, t_plain = run(args.files, False, args.sequential, out_dir)
        swapped, t_swap = run(args.files, True, args.sequential, out_dir)
    passed = {t for t, o in plain.items() if o == "passed"}
    regressions = sorted(t for t in passed if swapped.get(t) != "passed")
    documented = [t for t in regressions if short(t) in KNOWN_DIFFERENCES]
    unexpected = [t for t in regressions if short(t) not in KNOWN_DIFFERENCES]
    print(f"Keras {keras.__version__}: {len(args.files)} files, {len(plain)} tests")
    print(f"  passing with keras.Model:         {len(passed)} ({t_plain:.0f} s)")
    print(f"  of those, passing with the swap:  {len(passed) - len(regressions)} ({t_swap:.0f} s)")
    print(f"  documented differences:           {len(documented)}")
    for t in documented:
        print(f"    {short(t)}: {KNOWN_DIFFERENCES[short(t)]}")
    print(f"  UNEXPECTED failures with the swap: {len(unexpected)}")
    for t in unexpected:
        print(f"    {short(t)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
