"""`FastGradModel`: a `keras.Model` whose train step owns the gradient path.

The step reads as a chain of small units, each with its own module:

    forward + loss (tape watches only the trainable variables)
      -> unscale (loss_scaling) -> finite check (finite)
      -> accumulate (accumulation) -> clip (clipping) -> apply (applying)

and records what it measured in `telemetry`. `train_step` orchestrates; the
units do the maths.
"""

import contextlib
import functools
import warnings

import keras
import tensorflow as tf

from keras_fastgrad import _keras_compat as compat
from keras_fastgrad import _validation, aggregators
from keras_fastgrad.applying import apply_if
from keras_fastgrad.clipping import clip_by_global_norm, global_norm
from keras_fastgrad._replicas import (
    for_keras_reduction,
    global_metric_results,
    num_replicas,
    replica_sum,
)
from keras_fastgrad._gradients import scale
from keras_fastgrad.divergence import TrainingLoss, failed
from keras_fastgrad import finite
from keras_fastgrad.loss_scaling import LossScaling
from keras_fastgrad.slicing import check_micro_batches, first_input, sliced_gradients
from keras_fastgrad.multitask import (
    TaskMerger,
    check_task_count,
    regularization_loss,
    task_losses,
    task_names,
)
from keras_fastgrad._keras_integration import KerasIntegrationMixin
from keras_fastgrad._step_state import StepStateEntry, StepStateMixin
from keras_fastgrad.telemetry import LOG_KEYS
from keras_fastgrad.weighting import LossShares


@keras.saving.register_keras_serializable(package="keras_fastgrad")
class FastGradModel(StepStateMixin, KerasIntegrationMixin, keras.Model):
    """A `keras.Model` with exact accumulation, clipping and NaN safety.

    Use it wherever you would use `keras.Model` (functional or subclassed),
    then `compile` and `fit` as usual. With default options it trains
    exactly like `keras.Model`.

    Args:
        accumulation_steps: Integer >= 1, defaults to `1`. Number of batches
            (micro-batches) per optimizer update. The update equals one step
            on the concatenation of the window's batches: each micro-batch
            counts by its share of the window's samples, so uneven batches
            and sample weights are exact. `optimizer.iterations` counts
            updates. A window left partial at the end of an epoch is applied
            at the end of that epoch.
        clip_norm: Float > 0 or `None` (default). Clips the final gradient of
            each update (after accumulation) to this global L2 norm.
        multitask: `None` (default): the task losses are summed as in
            `keras.Model`. Or a multi-task method: a name from
            `keras_fastgrad.aggregators.NAMES` (`"pcgrad"`, `"mgda"`,
            `"cagrad"`, `"imtl"`, `"aligned"`, `"sum"`, `"mean"`) or an
            `Aggregator` instance. Each compiled output loss (times its
            loss weight) is a task; the task gradients over the shared
            variables are merged by the method, each task's own variables
            get its plain gradient, and the regularisation gradient is
            added after merging (see `keras_fastgrad.multitask`).
        skip_nonfinite: Boolean, defaults to `True`. A micro-batch whose loss
            or gradient holds NaN/Inf is dropped: it never touches the
            weights or the optimizer state, it is left out of its window's
            normalisation and counted (`nonfinite_count`). `False` applies
            such gradients like `keras.Model` does (a loss-scaled model still
            drops them: loss scaling needs it).
        micro_batches: Integer >= 1, defaults to `1`. Splits each batch into
            this many slices inside the step (a `tf.while_loop`): one update
            per batch, equal to the un-split step, with the activation
            memory of one slice (see `keras_fastgrad.slicing`).
        max_consecutive_nonfinite: Integer >= 1 or `None`, defaults to
            `10`. A run that drops this many micro-batches in a row (no
            update applied in between; loss-scale overflows that halving
            the scale can fix do not count) has diverged: `fit` stops with
            a `RuntimeWarning`. Periods in which nothing was kept, or that
            end while micro-batches are being dropped, log `loss=nan`, so
            best-checkpoint callbacks never pick them (see
            `keras_fastgrad.divergence`). `None` never stops.
        telemetry: Boolean, defaults to `False`. Adds the step's measurements
            (`grad_norm`, `nonfinite_count`, `loss_scale`, ... see
            `keras_fastgrad.telemetry.LOG_KEYS`) to the logs. The callbacks
            of `keras_fastgrad.callbacks` switch it on when attached.
        *args, **kwargs: Passed to `keras.Model`.

    Raises:
        ValueError, TypeError: on invalid options, naming the option, the
            rule and the value received. `compile` raises `ValueError` if
            the optimizer also accumulates or clips while the model does.

    Example:

    >>> inputs = keras.Input((3,))
    >>> outputs = keras.layers.Dense(1)(inputs)
    >>> model = FastGradModel(inputs, outputs, accumulation_steps=2,
    ...                       clip_norm=1.0)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((8, 3)), np.zeros((8, 1))
    >>> history = model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
    """

    def __init__(
        self,
        *args,
        accumulation_steps=1,
        clip_norm=None,
        multitask=None,
        skip_nonfinite=True,
        telemetry=False,
        micro_batches=1,
        max_consecutive_nonfinite=10,
        **kwargs,
    ):
        # `keras.models.clone_model` builds the clone as `type(model)(inputs,
        # outputs, name=...)`; `__new__` left the original's options here.
        cloned = vars(self).pop("_fg_cloned_options", None)
        if cloned is not None:
            accumulation_steps = cloned["accumulation_steps"]
            clip_norm = cloned["clip_norm"]
            multitask = cloned["multitask"]
            skip_nonfinite = cloned["skip_nonfinite"]
            telemetry = cloned["telemetry"]
            micro_batches = cloned["micro_batches"]
            max_consecutive_nonfinite = cloned["max_consecutive_nonfinite"]
        accumulation_steps = _validation.check_accumulation_steps(
            accumulation_steps
        )
        clip_norm = _validation.check_clip_norm(clip_norm)
        multitask = _validation.check_multitask(multitask)
        skip_nonfinite = _validation.check_bool("skip_nonfinite", skip_nonfinite)
        telemetry = _validation.check_bool("telemetry", telemetry)
        micro_batches = check_micro_batches(micro_batches)
        max_consecutive_nonfinite = _validation.check_optional_int(
            "max_consecutive_nonfinite", max_consecutive_nonfinite, 1,
            " (dropped micro-batches in a row before training stops) or None",
        )
        if micro_batches > 1 and multitask is not None:
            raise ValueError(
                "`micro_batches` and `multitask` cannot be combined yet: the "
                "multi-task merge needs each task's gradient on the whole "
                f"batch. Received: micro_batches={micro_batches}, "
                f"multitask={multitask!r}. Fix: use `accumulation_steps` with "
                "smaller batches instead of `micro_batches`."
            )
        if isinstance(self, compat.Functional) and compat.functional_init_arguments(args, kwargs):
            # What `keras.Model.__init__` does for the functional form,
            # without injecting `Functional` into this class's bases (which
            # would break later subclassed uses of `FastGradModel`).
            compat.init_functional(self, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        self.accumulation_steps = accumulation_steps
        self.clip_norm = clip_norm
        self.multitask = multitask
        self._fg_merger = None if multitask is None else TaskMerger(multitask)
        self.skip_nonfinite = skip_nonfinite
        self.telemetry = telemetry
        self.micro_batches = micro_batches
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self._fg_divergence = None
        self._fg_accumulator = None
        self._fg_telemetry = None
        self._fg_state_for = None
        self._fg_scaling = None
        self._fg_flush_function = None
        self._fg_in_fit = False
        self._fg_evaluating = 0
        self._fg_tape_variables = None
        self._fg_no_gradient = None
        self._fg_log_keys = set(LOG_KEYS) if telemetry else set()
        self._fg_trace_count = 0
        self._fg_divide_window = True
        # Saved as its own entry of `.keras` / `.weights.h5` files.
        self.fastgrad_step_state = StepStateEntry(self)

    # ------------------------------------------------------------ compile/fit
    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        # Keras' `loss` tracker, made honest about dropped micro-batches
        # (set as Keras' `compile` sets it: not tracked as a user metric).
        compat.set_loss_tracker(
            self, TrainingLoss(name="loss", streak=self._fg_streak)
        )
        _validation.check_optimizer_ownership(
            self.optimizer, self.accumulation_steps, self.clip_norm
        )
        if self._fg_merger is not None:
            check_task_count(self)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _validation.check_jit_compile_under_strategy(
            self.jit_compile, self.distribute_strategy
        )
        _validation.check_steps_per_execution_under_strategy(
            self.steps_per_execution, self.distribute_strategy
        )
        _validation.check_keras_supports_replicas(self.distribute_strategy)
        self._fg_build_state()
        if not self.optimizer.built:  # state must exist before tracing
            self.optimizer.build(self.trainable_variables)
        self._fg_scaling = LossScaling(self.optimizer)
        self._fg_flush_function = None
        return super().make_train_function(force=force)

    def apply_partial_window(self):
        """Applies the accumulated gradient of an incomplete window now.

        `fit` calls this at the end of every epoch. Call it yourself after a
        loop of `train_on_batch` calls. Does nothing without accumulation or
        when the window is empty.

        Returns:
            The telemetry logs (Python floats) after the flush, or `None`
            when nothing was pending.
        """
        acc = self._fg_accumulator
        if acc is None or int(acc.micro_step.numpy()) % acc.steps == 0:
            return None
        if self._fg_flush_function is None:
            # A `partial`, not a lambda: TF keys its retracing warning on a
            # function's code, shared by every model's lambda.
            self._fg_flush_function = tf.function(
                functools.partial(self.distribute_strategy.run, self._fg_flush_step),
                jit_compile=bool(self.jit_compile),
            )
        self._fg_flush_function()
        return {
            k: float(v)
            for k, v in self._fg_telemetry.logs(
                self._fg_scaling.current_scale(), self._fg_tape_variables or 0
            ).items()
        }

    def _fg_flush_step(self):
        acc = self._fg_accumulator
        apply_if(acc.has_samples(), self._fg_apply_window)
        acc.restart()

    # ------------------------------------------------------------- the step
    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_variables
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
        scaling = self._fg_scaling

        # Where micro-batches are combined (accumulation, replicas, slices),
        # each counts by its loss's own normaliser (`weighting.py`); the
        # factor is folded into the loss, not applied as a pass of its own.
        first = first_input(x)  # a clear `ValueError` when `x` holds no tensor
        num_rows = tf.shape(first)[0]
        num_samples = tf.cast(num_rows, tf.float32)
        weighted = (
            self._fg_accumulator is not None
            or num_replicas() > 1
            or self.micro_batches > 1
        )
        if self.micro_batches > 1:
            self._fg_check_slices(x)
            loss, y_pred, grads, share = sliced_gradients(
                self, x, y, sample_weight, variables, scaling, self.micro_batches
            )
            self._fg_record_trace_facts(variables, grads)
        else:
            loss, y_pred, grads, share = self._fg_batch_gradients(
                x, y, sample_weight, variables, num_rows if weighted else None
            )
        normaliser = share.real if weighted else tf.constant(1.0)
        self._fg_divide_window = share.mean if weighted else True
        checked = finite.marks(grads, loss)
        total = normaliser
        if num_replicas() > 1:  # one small all-reduce: decisions are global
            flags, total = replica_sum([finite.to_flags(checked), normaliser])
            checked = finite.from_flags(flags)
        all_finite = finite.is_finite(checked)
        keep = all_finite if (self.skip_nonfinite or scaling.active) else tf.constant(True)
        # Before `scaling.update`: the scale the micro-batch was dropped at.
        drop_args = (checked, failed(all_finite, scaling) if scaling.active else None)
        scaling.update(all_finite)
        if "input_shape_changes" in self._fg_log_keys:  # only when read
            self._fg_telemetry.record_input_shape(first)

        # The drop's bookkeeping rides in the other branch of a `cond` the
        # step has anyway, where it can (no extra `cond` per step).
        acc = self._fg_accumulator
        drops_with_keep = self.skip_nonfinite or scaling.active  # keep == finite
        metrics_loss = compat.unscale_loss_for_distribution(loss)
        if (
            acc is None
            and drops_with_keep
            and num_replicas() == 1
            and type(self).compute_metrics is keras.Model.compute_metrics
        ):  # one replica, default options: update and metrics in one `cond`
            logs = self._fg_update_or_drop(
                keep, (grads, total if weighted and share.mean else None), drop_args,
                (metrics_loss, num_samples, x, y, y_pred, sample_weight),
            )
            return self._fg_with_telemetry(logs)
        if acc is None:  # the update sums the gradients over replicas once
            update_args = (replica_sum(grads), total if weighted and share.mean else None)
        if acc is None and drops_with_keep:
            apply_if(
                keep, self._fg_update, args=update_args,
                otherwise=self._fg_record_drop, otherwise_args=drop_args,
            )
        elif acc is None:
            apply_if(tf.logical_not(all_finite), self._fg_record_drop, args=drop_args)
            apply_if(keep, self._fg_update, args=update_args)
        else:
            otherwise = None
            if drops_with_keep and num_replicas() == 1:
                otherwise = functools.partial(self._fg_record_drop, *drop_args)
            else:
                apply_if(tf.logical_not(all_finite), self._fg_record_drop, args=drop_args)
            window_complete = acc.add(grads, total, keep, otherwise=otherwise)
            apply_if(
                tf.logical_and(window_complete, acc.has_samples()),
                self._fg_apply_window,
            )

        logs = self._fg_compute_metrics(
            keep, metrics_loss, num_samples, x, y, y_pred, sample_weight
        )
        return self._fg_with_telemetry(global_metric_results(self.metrics, logs))

    def _fg_with_telemetry(self, logs):
        """The step's logs plus the requested telemetry keys."""
        if self._fg_log_keys:
            measured = self._fg_telemetry.logs(
                self._fg_scaling.current_scale(), self._fg_tape_variables
            )
            logs.update({k: v for k, v in measured.items() if k in self._fg_log_keys})
            if self._fg_merger is not None:  # task keys, from the Gram matrix
                logs.update(self._fg_merger.logs())
        return for_keras_reduction(logs)

    def _fg_batch_gradients(self, x, y, sample_weight, variables, num_rows):
        """Forward and backward on the whole batch (one tape); with
        `multitask`, the task gradients merged. Returns `(loss, y_pred,
        grads, share)`: the gradients unscaled and, when `num_rows` is
        given (micro-batches are combined), multiplied by the micro-batch's
        share (`weighting.LossShares`; `share` is `None` otherwise)."""
        scaling = self._fg_scaling
        merger = self._fg_merger
        shares = None if num_rows is None else LossShares(self, num_rows)
        with tf.GradientTape(
            watch_accessed_variables=False, persistent=merger is not None
        ) as tape:
            for v in variables:
                tape.watch(v.value)
            if compat.call_has_training_arg(self):
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            with shares or contextlib.nullcontext():
                if merger is None:
                    loss = compat.compute_loss(self, x, y, y_pred, sample_weight)
                else:  # one loss per task; regularisation is not a task
                    tasks = task_losses(self, y, y_pred, sample_weight)
                    regularization = regularization_loss(self)
                    loss = tf.add_n(
                        tasks + [r for r in [regularization] if r is not None]
                    )
            share = None if shares is None else shares.share()
            weight = None if share is None else share.loss_weight(num_replicas())
            if merger is None:
                scaled_loss = scaling.scale(loss, weight)
            else:
                scaled_tasks = [scaling.scale(t, weight) for t in tasks]
                if regularization is not None:
                    regularization = scaling.scale(regularization, weight)
        if merger is None:
            grads = tape.gradient(scaled_loss, [v.value for v in variables])
            self._fg_record_trace_facts(variables, grads)
            grads = scaling.unscale(grads, weight)
        else:  # each task's gradient is unscaled once, then merged
            grads, _ = merger(
                tape, scaled_tasks, regularization, variables,
                unscale=lambda g: scaling.unscale(g, weight),
                grad_scale=None if share is None else share.actual,
                task_names=task_names(self),
            )
            self._fg_record_trace_facts(variables, grads)
        return loss, y_pred, grads, share

    def _fg_streak(self):
        """The divergence streak variable while training (`TrainingLoss`
        reads it), `None` while evaluating or before the state exists."""
        if self._fg_evaluating or self._fg_divergence is None:
            return None
        return self._fg_divergence.streak

    def _fg_record_drop(self, checked, counts=None):
        """Bookkeeping of a non-finite micro-batch (in the branch that runs
        only then): where it went bad, and the divergence streak.

        Args:
            checked: The micro-batch's (global) `finite.marks` vector.
            counts: Boolean scalar, whether the drop counts towards the
                streak (`divergence.failed`, under loss scaling); `None`:
                it does.
        """
        first_bad, num_bad = finite.summarize(checked)
        self._fg_telemetry.record_drop(first_bad, num_bad)
        if self.skip_nonfinite or self._fg_scaling.active:
            self._fg_divergence.record_drop(
                tf.constant(True) if counts is None else counts
            )

    def _fg_check_slices(self, x):
        batch = first_input(x).shape[0]
        if batch is not None and batch < self.micro_batches:
            raise ValueError(
                "`micro_batches` must not exceed the batch size (each slice "
                f"needs a sample). Received: micro_batches={self.micro_batches} "
                f"for a batch of {batch}. Fix: a larger `batch_size` or fewer "
                "`micro_batches`."
            )

    def _fg_update_or_drop(self, keep, update_args, drop_args, metric_args):
        """One replica, no accumulation: the update and the metrics, or the
        drop's bookkeeping, in a single `cond` (every `cond` costs a few
        ops per step, which shows on short steps)."""

        def update():
            self._fg_update(*update_args)
            return self._fg_update_metrics(*metric_args)

        def drop():
            self._fg_record_drop(*drop_args)
            return self.get_metrics_result()

        return tf.cond(keep, update, drop)

    def _fg_compute_metrics(self, keep, loss, num_samples, x, y, y_pred, sample_weight):
        """Keras' `loss` tracker and metrics, left unchanged by a dropped
        micro-batch (its NaN would make them NaN for the rest of the
        epoch): one `cond`, in replica context."""
        if type(self).compute_metrics is not keras.Model.compute_metrics:
            # A user override may return other keys: call it as Keras does.
            return self._fg_update_metrics(
                tf.where(keep, loss, 0.0), tf.where(keep, num_samples, 0.0),
                x, y, y_pred, sample_weight,
            )
        return tf.cond(
            keep,
            lambda: self._fg_update_metrics(loss, num_samples, x, y, y_pred, sample_weight),
            self.get_metrics_result,
        )

    def _fg_update_metrics(self, loss, num_samples, x, y, y_pred, sample_weight):
        """Keras' `loss` tracker (weighted by the batch size, as Keras'
        `train_step` does) and compiled metrics; returns the logs."""
        compat.loss_tracker(self).update_state(loss, sample_weight=num_samples)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _fg_apply_window(self):
        acc = self._fg_accumulator
        self._fg_update(
            acc.window_sums(self._fg_no_gradient_template()),
            acc.normaliser if self._fg_divide_window else None,
        )
        acc.reset()

    def _fg_update(self, grads, normaliser=None):
        """Normalise, clip, check, apply, record.

        Runs in the update branch, in cross-replica context, on the global
        gradient (weighted sums divided by `normaliser` when it is given).
        """
        if normaliser is not None:
            grads = [scale(g, 1.0 / normaliser) for g in grads]
        telemetry = self._fg_telemetry
        variables = self.trainable_variables
        norm = was_clipped = None
        if "grad_norm" in self._fg_log_keys or self.clip_norm is not None:
            norm = global_norm(grads)
        telemetry.record_layer_norms(grads)
        if self.clip_norm is not None:
            grads, was_clipped = clip_by_global_norm(grads, self.clip_norm, norm)
        # Each micro-batch was finite, but a window's or the replicas' sum of
        # finite gradients can overflow: checked here, right before the
        # update (free with clipping: the norm is finite iff they all are).
        if self.clip_norm is not None:
            finite_update = tf.math.is_finite(norm)
        elif self._fg_accumulator is not None or num_replicas() > 1:
            finite_update = finite.all_finite(grads)
        else:
            finite_update = None  # the micro-batch check covered these

        def apply():
            before = telemetry.snapshot(variables)
            self._fg_scaling.apply(grads, variables)
            telemetry.record_update_ratio(before, variables)
            telemetry.record_update(norm, was_clipped)
            self._fg_divergence.record_update()
            return tf.constant(True)

        def drop():
            telemetry.record_dropped_update()
            self._fg_divergence.record_drop(tf.constant(True))
            return tf.constant(False)

        if finite_update is None:
            apply()
        else:
            tf.cond(finite_update, apply, drop)

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(self._fg_options())
        return config

    def _fg_options(self):
        """The constructor's options, serializable (`get_config`, clones)."""
        return {
            "accumulation_steps": self.accumulation_steps,
            "clip_norm": self.clip_norm,
            "multitask": (
                None
                if self.multitask is None
                else aggregators.serialize(self.multitask)
            ),
            "skip_nonfinite": self.skip_nonfinite,
            "telemetry": self.telemetry,
            "micro_batches": self.micro_batches,
            "max_consecutive_nonfinite": self.max_consecutive_nonfinite,
        }
