"""TensorFlow for keras_fastgrad: imported only on Keras' TensorFlow
backend, its start-up notices held to `TF_CPP_MIN_LOG_LEVEL`.

Importing this module imports TensorFlow when the backend Keras runs on
(or will run on: `keras_backend`) is TensorFlow (`import_tensorflow`): the
package's `__init__` imports it before Keras. On Keras' JAX backend
TensorFlow is neither imported nor needed: the package's modules name it
through `tf` below, a stand-in that imports TensorFlow where one of its
names is first used, which only the TensorFlow step does.

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

import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import types

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


def keras_backend():
    """The name of Keras' backend: Keras' own answer once it is imported,
    else the one Keras will choose, as it does (`KERAS_BACKEND` when set
    and not empty, else `"backend"` in `keras.json` of `KERAS_HOME`, by
    default `~/.keras`, else `"tensorflow"`)."""
    backend = getattr(getattr(sys.modules.get("keras"), "backend", None), "backend", None)
    if callable(backend):
        return backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME")
    if home is None:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    try:
        with open(os.path.join(os.path.expanduser(home), "keras.json")) as file:
            config = json.load(file)
    except (OSError, ValueError):
        return "tensorflow"
    backend = config.get("backend", "tensorflow") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) else "tensorflow"


class _TensorFlow(types.ModuleType):
    """`tensorflow`, imported where one of its names is first used (the
    TensorFlow step), so that the JAX step neither imports nor needs it."""

    def __getattr__(self, name):
        if name.startswith("__"):  # introspection (doctest, pickle): not TF's
            raise AttributeError(name)
        try:
            module = importlib.import_module("tensorflow")
        except ImportError as error:
            raise ImportError(
                f"keras_fastgrad uses TensorFlow here (`tf.{name}`), which only "
                "its TensorFlow step needs. Received: Keras backend "
                f"{keras_backend()!r}, TensorFlow not importable ({error}). Fix: "
                "`pip install tensorflow`, or report this as a bug if the backend "
                "is not TensorFlow."
            ) from error
        return getattr(module, name)


tf = _TensorFlow("tensorflow")


def import_tensorflow():
    """Imports TensorFlow, its start-up notices held to `min_log_level()`,
    when Keras' backend is TensorFlow (`keras_backend()`)."""
    if keras_backend() != "tensorflow":
        return  # JAX needs no TensorFlow; `__init__` refuses others, naming them
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
