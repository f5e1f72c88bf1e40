"""TensorFlow's start-up notices, held to `TF_CPP_MIN_LOG_LEVEL`.

Importing this module imports TensorFlow (`import_tensorflow`): the
package's `__init__` imports it before Keras.

TensorFlow 2.21 logs a few lines while it is imported, before its logging
has read `TF_CPP_MIN_LOG_LEVEL`: absl's "All log messages before
absl::InitializeLog() is called are written to STDERR", the oneDNN notice
and the CPU-feature notice, once for each of its shared libraries that
logs on load (tensorflow/tensorflow#100442). `TF_CPP_MIN_LOG_LEVEL=3`
does not hide them. When keras_fastgrad is the first to import
TensorFlow, `import_tensorflow` holds the process' standard error aside
for the import, then writes back everything except the log records below
that level (and absl's banner): a Python warning, a traceback, a fatal
record or anything else TensorFlow prints still shows. Nothing is held
when the level is 0 (TensorFlow's default) or TensorFlow is already
imported.
"""

import importlib.util
import os
import re
import sys
import tempfile

_SEVERITIES = "IWEF"
# absl's format (`I0000 00:00:1796186066.075090    8436 port.cc:153] ...`)
# and TensorFlow's own (`2025-07-24 10:38:25.697969: I tensorflow/...:153] ...`).
_RECORD = re.compile(
    r"(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) )\S+:\d+\] "
)
_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The second line of the CPU-feature notice (a record of two lines).
_CONTINUATIONS = ("To enable the following instructions:",)


def min_log_level():
    """The level the start-up notices are held to: `TF_CPP_MIN_LOG_LEVEL`
    when set (0 shows everything, 1 hides INFO, 2 also WARNING, 3 also
    ERROR), else 3 while `python -m keras_fastgrad.<program>` (the demo,
    the profiler) starts, else 0."""
    value = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    if value is not None:
        return int(value) if value.strip().isdigit() else 0
    return 3 if _starting_own_program() else 0


def _starting_own_program():
    # While `python -m <module>` imports the module's packages, Python
    # holds "-m" in sys.argv[0]; sys.orig_argv (Python >= 3.10) names the
    # module.
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", None)
    if argv is None:
        return True
    for i, arg in enumerate(argv):
        if arg.startswith("-m"):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return module.split(".")[0] == "keras_fastgrad"
    return False


def without_notices(text, level):
    """`text` without the log records below `level` (never a fatal one),
    their continuation lines, and absl's banner (for any `level >= 1`)."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        record = _RECORD.match(line)
        if record:
            severity = _SEVERITIES.index(record.group(1) or record.group(2))
            dropping = severity < min(level, 3)
        elif line.rstrip("\r\n") == _BANNER:
            dropping = level >= 1
        elif not (dropping and line.startswith(_CONTINUATIONS)):
            dropping = False
        if not dropping:
            kept.append(line)
    return "".join(kept)


def import_tensorflow():
    """Imports TensorFlow, its start-up notices held to `min_log_level()`."""
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        return  # the package's `__init__` refuses the backend, naming it
    if importlib.util.find_spec("tensorflow") is None:
        return  # Keras' own import says what is missing
    level = min_log_level()
    if "tensorflow" in sys.modules or level < 1:
        import tensorflow  # noqa: F401

        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no standard error to hold
        import tensorflow  # noqa: F401

        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = without_notices(held.read().decode("utf-8", "replace"), level)
            if rest:
                os.write(2, rest.encode("utf-8"))


import_tensorflow()
