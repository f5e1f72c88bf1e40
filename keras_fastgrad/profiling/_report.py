"""The reading side of `profile_step`: argument checks, the table, the
recommendations that follow from the numbers, and the bar chart."""

import keras

from keras_fastgrad._validation import check_int
from keras_fastgrad.profiling._runs import MODES, is_dataset

LABELS = {
    "eager": "eager",
    "function": "tf.function",
    "xla": "tf.function + XLA",
    "mixed_float16": "mixed_float16",
    "mixed_bfloat16": "mixed_bfloat16",
}


def label(mode):
    """The mode's name in the table (on JAX the compiled mode is `jax.jit`)."""
    if mode == "xla" and keras.backend.backend() == "jax":
        return "jax.jit (XLA)"
    return LABELS[mode]


# Below these a difference is within the noise of a shared machine.
CLEAR_GAIN, CLEAR_LOSS = 1.10, 0.90
BACKWARD_FORWARD_LIMIT = 3.0  # backward is usually 1-2x forward
UPDATE_SHARE_LIMIT = 0.5


def check_arguments(model, modes, repeats, warmup, batch_size, verbose, data):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    if not model.compiled or model.optimizer is None:
        raise ValueError(
            "`model` must be compiled: the profiler runs its train step. "
            f"Call `model.compile(optimizer=..., loss=...)` first. Received: "
            f"an uncompiled model {model.name!r}"
        )
    if keras.backend.backend() == "jax" and keras.distribution.distribution() is not None:
        raise ValueError(
            "`model` must live on one device: `profile_step` times a "
            "single-device step. Profile it without the distribution "
            "(`keras.distribution.set_distribution(None)`). Received: "
            f"distribution={keras.distribution.distribution()!r}"
        )
    if keras.backend.backend() != "jax" and model.distribute_strategy.num_replicas_in_sync > 1:
        raise ValueError(
            "`model` must live on one device: `profile_step` times a "
            "single-device step. Build and compile the model outside the "
            "strategy scope to profile it. Received: a model under "
            f"{type(model.distribute_strategy).__name__} with "
            f"{model.distribute_strategy.num_replicas_in_sync} replicas"
        )
    if isinstance(modes, str) or not all(isinstance(m, str) for m in modes):
        raise TypeError(
            f"`modes` must be a sequence of names from {list(MODES)}. Received: modes={modes!r}"
        )
    modes = tuple(dict.fromkeys(modes))
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise ValueError(
            f"`modes` must be a non-empty sequence of names from "
            f"{list(MODES)}. Received: modes={modes!r}"
        )
    repeats = _check_int("repeats", repeats, 1, "timed rounds")
    warmup = _check_int("warmup", warmup, 1, "untimed calls, the first one traces")
    if batch_size is not None:
        batch_size = _check_int("batch_size", batch_size, 1, "samples profiled")
        if is_dataset(data):
            raise ValueError(
                "`batch_size` must be `None` when `data` is a `tf.data.Dataset` "
                "(its batches are profiled as they come). Received: "
                f"batch_size={batch_size}"
            )
    if verbose not in (0, 1) or isinstance(verbose, bool):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    if isinstance(data, (dict, str)) or data is None:
        raise TypeError(
            "`data` must be a batch `(x, y)` or `(x, y, sample_weight)`, an "
            "array `x` or a `tf.data.Dataset` of such batches. Received: "
            f"data of type {type(data).__name__}"
        )
    return modes, repeats, warmup, batch_size, verbose


def _check_int(name, value, minimum, meaning):
    return check_int(name, value, minimum, f" ({meaning})")


class ReportMixin:
    """`table`, `recommendations`, `save_png` for `StepProfile`."""

    def table(self):
        """The measurements as a fixed-width text table."""
        lines = [
            f"Step profile of {self.model_class} {self.model_name!r} (batch "
            f"{self.batch_size}; median ms over {self.repeats} interleaved "
            f"rounds, {self.warmup} warm-up call(s) excluded; speedups are of "
            "the full step)",
            f"{'mode':18s} {'forward':>8s} {'fwd+bwd':>8s} {'step':>8s} "
            f"{'backward':>8s} {'update':>8s} {'bwd/fwd':>7s} "
            f"{'vs eager':>9s} {'vs tf.function':>14s}",
        ]
        for mode, t in self.phases.items():
            lines.append(
                f"{label(mode):18s} {t.forward_ms:8.2f} {t.forward_backward_ms:8.2f} "
                f"{t.step_ms:8.2f} {t.backward_ms:8.2f} {t.update_ms:8.2f} "
                f"{t.backward_forward_ratio:7.2f} "
                f"{_times(self.speedup(mode, 'eager')):>9s} "
                f"{_times(self.speedup(mode, 'function')):>14s}"
            )
        for mode, reason in self.skipped.items():
            lines.append(f"{label(mode):18s} skipped: {reason}")
        if self.data_ms is not None:
            lines.append(
                f"input pipeline: {self.data_ms:.2f} ms per batch from the "
                f"dataset ({self.data_shapes} distinct batch shape(s) seen)"
            )
        if self.traces is not None:
            note = "no retracing" if self.traces <= 1 else "RETRACED"
            lines.append(f"traces of the compiled step: {self.traces} ({note})")
        lines.append(
            f"tape-watched variables: {self.tape_variables}; trainable "
            f"variables: {self.trainable_variables}"
        )
        return "\n".join(lines)

    def recommendations(self):
        """What the numbers suggest, as a list of sentences."""
        out = []
        main = (
            self.phases.get(self.model_mode)
            or self.phases.get("function")
            or next(iter(self.phases.values()), None)
        )
        if main is not None and main.backward_ms < 0:
            out.append(
                "Timings are noisy (forward + backward measured faster than "
                "forward alone): raise `repeats` or profile a larger batch."
            )
        elif main is not None and main.backward_forward_ratio > BACKWARD_FORWARD_LIMIT:
            out.append(
                f"Backward takes {main.backward_forward_ratio:.1f}x the forward "
                "pass (usually 1-2x): look for ops with costly gradients "
                "(gathers/scatters, large embeddings, loops, custom gradients) "
                "and for layers that need no gradient (freeze them)."
            )
        if (
            main is not None
            and main.step_ms > 0
            and main.update_ms / main.step_ms > UPDATE_SHARE_LIMIT
        ):
            out.append(
                f"The update (step - forward - backward) takes "
                f"{100 * main.update_ms / main.step_ms:.0f}% of the step: the "
                "optimizer or per-step metrics dominate. Larger batches, or "
                "`accumulation_steps` to apply updates less often, amortise it."
            )
        if self.traces is not None and self.traces > 1:
            out.append(
                f"The compiled step was traced {self.traces} times on one fixed "
                "batch: something in the step changes between calls (Python "
                "values or new objects passed in, Python state read in the "
                "step). Every retrace rebuilds (and under XLA recompiles) the "
                "graph."
            )
        if self.data_shapes is not None and self.data_shapes > 1:
            out.append(
                f"The dataset yields {self.data_shapes} different batch shapes "
                "(a short last batch?): under XLA each new shape compiles the "
                "step again. Fix: `dataset.batch(n, drop_remainder=True)`."
            )
        if self.tape_variables is not None and self.tape_variables != self.trainable_variables:
            out.append(
                f"The gradient tape watches {self.tape_variables} variables but "
                f"the model has {self.trainable_variables} trainable ones "
                "(Keras' default tape also watches frozen layers' variables; "
                "a FastGradModel traced before `trainable` changed keeps the "
                "old set). Fix: recompile after freezing; `FastGradModel` "
                "watches exactly the trainable variables."
            )
        step = main.step_ms if main is not None else None
        if self.data_ms is not None and step is not None and self.data_ms > step:
            out.append(
                f"The input pipeline is slower than the step ({self.data_ms:.2f} "
                f"vs {step:.2f} ms per batch): training waits for data. Add "
                "`.prefetch(tf.data.AUTOTUNE)`, `num_parallel_calls` in `map`, "
                "`.cache()`, or move preprocessing into the model."
            )
        out += self._mode_advice()
        return out or ["No bottleneck found by these checks."]

    def _mode_advice(self):
        out = []
        eager = self.speedup("function", "eager")
        if self.model_mode == "eager" and eager and eager > CLEAR_GAIN:
            out.append(
                f"The model runs eagerly (`run_eagerly=True`); tf.function is "
                f"{eager:.1f}x faster: compile with `run_eagerly=False`."
            )
        xla = self.speedup("xla", "function")
        if xla and xla > CLEAR_GAIN and self.model_mode != "xla":
            out.append(
                f"XLA makes the step {xla:.2f}x faster than tf.function: "
                "`model.compile(..., jit_compile=True)`."
            )
        elif xla and xla < CLEAR_LOSS and self.model_mode == "xla":
            out.append(
                f"XLA is slower here ({xla:.2f}x of tf.function): compile with `jit_compile=False`."
            )
        for policy in ("mixed_float16", "mixed_bfloat16"):
            mixed = self.speedup(policy, "function")
            if mixed and mixed > CLEAR_GAIN:
                out.append(
                    f"{policy} makes the step {mixed:.2f}x faster than float32: "
                    f"call `keras.mixed_precision.set_global_policy('{policy}')` "
                    "before building the model."
                )
            elif mixed and mixed < CLEAR_LOSS:
                out.append(
                    f"{policy} is slower on this device ({mixed:.2f}x of "
                    "float32: no fast units for that type): keep float32 for "
                    "it here."
                )
        return out

    def __str__(self):
        advice = "\n".join(f"- {line}" for line in self.recommendations())
        return f"{self.table()}\nRecommendations:\n{advice}"

    def save_png(self, path):
        """Saves a bar chart of the phases per mode (needs matplotlib).

        Args:
            path: File path of the PNG to write.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:  # pragma: no cover - message for users
            raise ImportError("`save_png` needs matplotlib. Fix: pip install matplotlib") from e
        # A Figure on the Agg canvas: no pyplot, the user's backend is untouched.
        rows = list(self.phases.items())
        fig = Figure(figsize=(8, 1.4 + 0.75 * (len(rows) + (self.data_ms is not None))))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        height = 0.26
        for k, (name, part, color) in enumerate(
            (
                ("forward", lambda t: t.forward_ms, "tab:blue"),
                ("forward + backward", lambda t: t.forward_backward_ms, "tab:orange"),
                ("full step", lambda t: t.step_ms, "tab:green"),
            )
        ):
            ax.barh(
                [i + (k - 1) * height for i in range(len(rows))],
                [part(t) for _, t in rows],
                height=height,
                color=color,
                label=name,
            )
        for i, (mode, t) in enumerate(rows):
            speed = self.speedup(mode, "eager")
            note = f" {t.step_ms:.2f} ms" + (f" ({speed:.1f}x eager)" if speed else "")
            ax.text(t.step_ms, i + height, note, va="center", fontsize=8)
        labels = [label(m) for m, _ in rows]
        if self.data_ms is not None:
            ax.barh(
                [len(rows)],
                [self.data_ms],
                height=height,
                color="tab:gray",
                label="input pipeline (per batch)",
            )
            labels.append("input pipeline")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        values = [t.forward_ms for _, t in rows] + [t.step_ms for _, t in rows]
        values = [v for v in values + [self.data_ms or 0.0] if v > 0]
        if values and max(values) / min(values) > 30:  # e.g. float16 on a CPU
            ax.set_xscale("log")
            ax.set_xlim(0.5 * min(values), 6 * max(values))
        else:
            ax.set_xlim(0, 1.45 * max(values or [1.0]))
        ax.set_xlabel("median ms per call" + (" (log scale)" if ax.get_xscale() == "log" else ""))
        ax.set_title(
            f"{self.model_class} {self.model_name!r}, batch {self.batch_size}", fontsize=10
        )
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path


def _times(value):
    return "-" if value is None else f"{value:.2f}x"
