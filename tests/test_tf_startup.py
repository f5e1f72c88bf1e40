"""TensorFlow's start-up notices held to TF_CPP_MIN_LOG_LEVEL
(keras_fastgrad/_tf_startup.py): the demo and the tests print none, and
nothing else is hidden."""

import os
import subprocess
import sys

import pytest

from keras_fastgrad import _tf_startup

pytestmark = pytest.mark.tensorflow_only(reason="TensorFlow's start-up notices")

# What `import tensorflow` 2.21 printed with TF_CPP_MIN_LOG_LEVEL=3 (the
# lines after the banner repeat for its second library), with a Python
# warning and lines TensorFlow's older format writes.
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (
    "I0000 00:00:1796186066.075090    8436 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results due to floating-point round-off "
    "errors from different computation orders. To turn them off, set the environment "
    "variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
)
CPU_FEATURES = (
    "I0000 00:00:1796186066.188206    8436 cpu_feature_guard.cc:227] This TensorFlow binary "
    "is optimized to use available CPU instructions in performance-critical operations.\n"
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in "
    "other operations, rebuild TensorFlow with the appropriate compiler flags.\n"
)
WARNING = "/site-packages/x.py:3: UserWarning: something that matters\n  warnings.warn(\n"
CUDA_ERROR = (
    "E0000 00:00:1765464952.116801  640792 cuda_dnn.cc:8579] Unable to register cuDNN "
    "factory: Attempting to register factory for plugin cuDNN when one has already been "
    "registered\n"
)
OLD_FORMAT_WARNING = (
    "2024-01-25 23:03:23.827518: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
    "TF-TRT Warning: Could not find TensorRT\n"
)
FATAL = "F0000 00:00:1765464952.123229  640792 stream.cc:1] Check failed: x\n"
PRINTED = (
    BANNER + ONEDNN + CPU_FEATURES + WARNING + CUDA_ERROR + OLD_FORMAT_WARNING + BANNER + ONEDNN
)


@pytest.mark.parametrize(
    "level, kept",
    [
        (0, PRINTED),
        (1, WARNING + CUDA_ERROR + OLD_FORMAT_WARNING),
        (2, WARNING + CUDA_ERROR),
        (3, WARNING),
    ],
)
def test_records_below_the_level_are_dropped_and_nothing_else(level, kept):
    # The level's meaning is TensorFlow's: 1 hides INFO, 2 WARNING too,
    # 3 ERROR too.
    assert _tf_startup.without_notices(PRINTED, level) == kept
    assert _tf_startup.without_notices(PRINTED + FATAL, level) == kept + FATAL


def test_a_continuation_line_goes_only_with_a_dropped_record():
    assert _tf_startup.without_notices(WARNING + CPU_FEATURES.splitlines(True)[1], 3) == (
        WARNING + CPU_FEATURES.splitlines(True)[1]
    )


@pytest.mark.parametrize(
    "value, argv, orig_argv, level",
    [
        ("2", ["-m"], None, 2),
        ("0", ["-m"], ["python", "-m", "keras_fastgrad.demo"], 0),
        ("x", [], None, 0),
        (None, ["prog.py"], ["python", "prog.py"], 0),
        (None, ["-m"], ["python", "-m", "keras_fastgrad.demo"], 3),
        (None, ["-m"], ["python", "-mkeras_fastgrad.profile"], 3),
        (None, ["-m"], ["python", "-m", "someone_else.tool"], 0),
    ],
)
def test_the_level_is_tensorflows_variable_else_3_for_the_packages_programs(
    monkeypatch, value, argv, orig_argv, level
):
    if value is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", value)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv or [], raising=False)
    assert _tf_startup.min_log_level() == level


def test_the_demo_and_an_import_print_no_tensorflow_lines():
    # Fresh processes: `python -m keras_fastgrad.demo` (its argument parser
    # only: TensorFlow is imported all the same) without the variable, and
    # `import keras_fastgrad` with it. Before, each printed 4 to 6 lines.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    demo = subprocess.run(
        [sys.executable, "-m", "keras_fastgrad.demo", "--help"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert demo.stderr == "" and "--epochs" in demo.stdout
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    code = "import warnings, keras_fastgrad; warnings.warn('kept')"
    imported = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert imported.stderr.splitlines() == ["<string>:1: UserWarning: kept"]
