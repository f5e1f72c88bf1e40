"""`FastGradModel`: a `keras.Model` whose train step owns the gradient path.

The step reads as a chain of small units, each with its own module:

    forward + loss (tape watches only the trainable variables)
      -> unscale (loss_scaling) -> finite check (finite)
      -> accumulate (accumulation) -> clip (clipping) -> apply (applying)

and records what it measured in `telemetry`. `train_step` orchestrates; the
units do the maths.
"""

import collections
import contextlib
import functools
import inspect
import warnings

import keras
import tensorflow as tf

from keras_fastgrad import _keras_compat as compat
from keras_fastgrad import _validation, aggregators, feature_space
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
from keras_fastgrad._keras_integration import KerasIntegrationMixin, _functional_variant
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
        multitask_space: `"parameters"` (default) or `"features"`. Where
            the `multitask` method compares the tasks. `"parameters"`: the
            task gradients over the shared variables (exact, `T` backward
            passes through the trunk). `"features"`: the task gradients
            with respect to the shared representation `Z` (MGDA-UB), then
            one trunk backward pass of their weighted sum; the heads get
            their plain gradients (see `keras_fastgrad.feature_space`).
        multitask_features: `None` (default) or a layer name, with
            `multitask_space="features"`: the layer whose output is `Z`.
            `None` finds `Z` in a functional model (the deepest tensor all
            outputs depend on); a subclassed model must name it.
        skip_nonfinite: Boolean, defaults to `True`. A micro-batch whose loss
            or gradient holds NaN/Inf is dropped: it never touches the
            weights or the optimizer state, it is left out of its window's
            normalisation and counted (`nonfinite_count`). `False` applies
            such gradients like `keras.Model` does (a loss-scaled model still
            drops them: loss scaling needs it).
        micro_batches: Integer >= 1, defaults to `1`. Splits each batch into
            this many slices inside the step (a `tf.while_loop`): one update
            per batch, equal to the un-split step, with the activation
            memory of one slice (see `keras_fastgrad.slicing`). With
            `multitask`, the task gradients are summed over the slices and
            merged once.
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
        multitask_space="parameters",
        multitask_features=None,
        **kwargs,
    ):
        # Options saved by `get_config` under `fastgrad_options` (a subclass
        # with its own `__init__`), or left by `__new__` for a clone made by
        # `keras.models.clone_model`: the trained model's options win.
        restored = kwargs.pop("fastgrad_options", None)
        restored = vars(self).pop("_fg_cloned_options", None) or restored
        given = locals()
        options = _checked_options(
            **{**{name: given[name] for name in OPTION_NAMES}, **(restored or {})}
        )
        if compat.functional_init_arguments(args, kwargs) and not isinstance(
            self, keras.Sequential
        ):
            if not isinstance(self, compat.Functional):
                # `super().__init__(inputs=..., outputs=...)` from a
                # subclass's `__init__`: Keras would rewrite the bases of
                # every class up to `keras.Model` (and so break every later
                # subclassed `FastGradModel`); this instance gets the
                # class's functional variant instead.
                self.__class__ = _functional_variant(type(self))
            # What `keras.Model.__init__` does for the functional form,
            # without injecting `Functional` into this class's bases (which
            # would break later subclassed uses of `FastGradModel`).
            compat.init_functional(self, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._fg_setup(options)

    def _fg_setup(self, options):
        """The step's options and (empty) state on a Keras-initialised
        model: from `__init__`, or on an existing model (`fastgrad`)."""
        self._fg_set_options(options)
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
        self._fg_trace_count = 0
        self._fg_divide_window = True
        # Saved as its own entry of `.keras` / `.weights.h5` files.
        self.fastgrad_step_state = StepStateEntry(self)

    def _fg_set_options(self, options):
        """Sets the (checked) constructor options on the model."""
        for name, value in options.items():
            setattr(self, name, value)
        self._fg_merger = (
            None if self.multitask is None else TaskMerger(self.multitask)
        )
        self._fg_log_keys = set(LOG_KEYS) if self.telemetry else set()

    # ------------------------------------------------------------ compile/fit
    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self._fg_after_compile()

    def _fg_after_compile(self):
        """What the step needs of a compiled model (also for a model
        compiled before `fastgrad` gave it the step)."""
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
        """One micro-batch through the chain:

        forward + backward (+ unscale, + task merge) -> finite check
          -> accumulate -> [window complete] clip -> check -> apply

        then Keras' loss tracker and metrics, and the telemetry keys. A
        micro-batch whose loss or gradient is not finite is dropped (with
        `skip_nonfinite`, or under loss scaling) and counted instead.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = self._fg_gradients(x, y, sample_weight)
        verdict = self._fg_finite_check(batch)
        if self._fg_single_cond():  # one replica, no accumulation
            logs = self._fg_update_or_drop(batch, verdict)
        else:
            self._fg_accumulate_or_apply(batch, verdict)
            logs = global_metric_results(
                self.metrics, self._fg_compute_metrics(verdict.keep, batch)
            )
        return self._fg_with_telemetry(logs)

    def _fg_gradients(self, x, y, sample_weight):
        """Forward and backward (whole batch, or `micro_batches` slices);
        the gradients unscaled and, where micro-batches are combined
        (accumulation, replicas, slices), weighted by the micro-batch's
        share of the window (`weighting.py`; folded into the loss)."""
        variables = self.trainable_variables
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
        try:
            first = first_input(x)  # a `ValueError` when `x` holds no tensor
        except ValueError:
            # Keras' own error first where it has one (a required input is
            # `None`: "not optional"), as `keras.Model` raises it.
            self(x, **({"training": True} if compat.call_has_training_arg(self) else {}))
            raise
        if "input_shape_changes" in self._fg_log_keys:  # only when read
            self._fg_telemetry.record_input_shape(first)
        num_rows = tf.shape(first)[0]
        weighted = (
            self._fg_accumulator is not None
            or num_replicas() > 1
            or self.micro_batches > 1
        )
        if self.micro_batches > 1:
            self._fg_check_slices(x)
            loss, y_pred, grads, share = sliced_gradients(
                self, x, y, sample_weight, variables, self._fg_scaling,
                self.micro_batches, merger=self._fg_merger,
            )
            self._fg_record_trace_facts(variables, grads)
        else:
            loss, y_pred, grads, share = self._fg_batch_gradients(
                x, y, sample_weight, variables, num_rows if weighted else None
            )
        # The normaliser the window's sum is divided by (`None`: the
        # gradients are already the mean, or a "sum" loss is summed).
        self._fg_divide_window = share.mean if weighted else True
        return _Batch(
            loss=loss, y_pred=y_pred, grads=grads, x=x, y=y,
            sample_weight=sample_weight,
            num_samples=tf.cast(num_rows, tf.float32),
            normaliser=share.real if weighted else tf.constant(1.0),
            divide=weighted and share.mean,
        )

    def _fg_finite_check(self, batch):
        """Is the micro-batch finite (on every replica: one small
        all-reduce, so every replica decides alike)? Updates the loss
        scale. Returns a `_Verdict`."""
        scaling = self._fg_scaling
        checked = finite.marks(batch.grads, batch.loss)
        total = batch.normaliser
        if num_replicas() > 1:
            flags, total = replica_sum([finite.to_flags(checked), total])
            checked = finite.from_flags(flags)
        all_finite = finite.is_finite(checked)
        drops = self.skip_nonfinite or scaling.active  # keep == finite
        # Before `scaling.update`: the scale the micro-batch was dropped at.
        counts = failed(all_finite, scaling) if scaling.active else None
        scaling.update(all_finite)
        return _Verdict(
            checked=checked, all_finite=all_finite,
            keep=all_finite if drops else tf.constant(True),
            drops=drops, counts=counts, total=total,
        )

    def _fg_single_cond(self):
        """One replica, no accumulation, default metrics: the update and
        the metrics share one `cond` (`_fg_update_or_drop`)."""
        return (
            self._fg_accumulator is None
            and (self.skip_nonfinite or self._fg_scaling.active)
            and num_replicas() == 1
            and type(self).compute_metrics is keras.Model.compute_metrics
        )

    def _fg_accumulate_or_apply(self, batch, verdict):
        """Without accumulation: apply the (replica-summed) gradient, or
        record the drop. With it: add to the window, and apply the window
        once complete. Drop bookkeeping rides in the other branch of a
        `cond` the step has anyway, where it can."""
        acc = self._fg_accumulator
        drop_args = (verdict.checked, verdict.counts)
        not_finite = tf.logical_not(verdict.all_finite)
        if acc is None:
            update_args = (
                replica_sum(batch.grads), verdict.total if batch.divide else None
            )
            if verdict.drops:
                apply_if(
                    verdict.keep, self._fg_update, args=update_args,
                    otherwise=self._fg_record_drop, otherwise_args=drop_args,
                )
            else:  # non-finite gradients are applied, as keras.Model does
                apply_if(not_finite, self._fg_record_drop, args=drop_args)
                apply_if(verdict.keep, self._fg_update, args=update_args)
            return
        otherwise = None
        if verdict.drops and num_replicas() == 1:
            otherwise = functools.partial(self._fg_record_drop, *drop_args)
        else:
            apply_if(not_finite, self._fg_record_drop, args=drop_args)
        window_complete = acc.add(batch.grads, verdict.total, verdict.keep, otherwise=otherwise)
        apply_if(tf.logical_and(window_complete, acc.has_samples()), self._fg_apply_window)

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
            features = feature_space.capture(self, tape)  # no-op unless "features"
            with features:
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
            merge = features.merger(merger) if features.active else merger
            grads, _ = merge(
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

    def _fg_update_or_drop(self, batch, verdict):
        """One replica, no accumulation: the update and the metrics, or the
        drop's bookkeeping, in a single `cond` (every `cond` costs a few
        ops per step, which shows on short steps)."""

        def update():
            self._fg_update(batch.grads, verdict.total if batch.divide else None)
            return self._fg_update_metrics(batch, compat.unscale_loss_for_distribution(batch.loss))

        def drop():
            self._fg_record_drop(verdict.checked, verdict.counts)
            return self.get_metrics_result()

        return tf.cond(verdict.keep, update, drop)

    def _fg_compute_metrics(self, keep, batch):
        """Keras' `loss` tracker and metrics, left unchanged by a dropped
        micro-batch (its NaN would make them NaN for the rest of the
        epoch): one `cond`, in replica context."""
        loss = compat.unscale_loss_for_distribution(batch.loss)
        if type(self).compute_metrics is not keras.Model.compute_metrics:
            # A user override may return other keys: call it as Keras does.
            return self._fg_update_metrics(
                batch, tf.where(keep, loss, 0.0), tf.where(keep, batch.num_samples, 0.0)
            )
        return tf.cond(
            keep, lambda: self._fg_update_metrics(batch, loss), self.get_metrics_result
        )

    def _fg_update_metrics(self, batch, loss, num_samples=None):
        """Keras' `loss` tracker (weighted by the batch size, as Keras'
        `train_step` does) and compiled metrics; returns the logs."""
        compat.loss_tracker(self).update_state(
            loss, sample_weight=batch.num_samples if num_samples is None else num_samples
        )
        return self.compute_metrics(
            batch.x, batch.y, batch.y_pred, sample_weight=batch.sample_weight
        )

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
    @compat.keras_default  # Keras' automatic config of a subclass's own arguments
    def get_config(self):
        config = super().get_config()
        if _takes_options(type(self)):
            config.update(self._fg_options())
        else:  # a subclass with its own `__init__`: applied by `from_config`
            config["fastgrad_options"] = self._fg_options()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The options are set after Keras has built the model from the rest
        # (a subclass's `__init__`, a `Sequential`'s layers, ...).
        config = dict(config)
        options = config.pop("fastgrad_options", None) or {}
        if _takes_options(cls):
            options.update({k: config.pop(k) for k in OPTION_NAMES if k in config})
        model = super().from_config(config, custom_objects=custom_objects)
        if options and isinstance(model, FastGradModel):
            model._fg_set_options(_checked_options(**{**model._fg_options(), **options}))
        return model

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
            "multitask_space": self.multitask_space,
            "multitask_features": self.multitask_features,
        }


# The constructor's options and their defaults, read off its signature.
_DEFAULT_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(FastGradModel.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}
OPTION_NAMES = tuple(_DEFAULT_OPTIONS)


def _checked_options(**options):
    """The constructor's options (defaults for those not given),
    validated (Keras-style errors)."""
    options = {**_DEFAULT_OPTIONS, **options}
    micro_batches = check_micro_batches(options["micro_batches"])
    multitask = _validation.check_multitask(options["multitask"])
    if micro_batches > 1 and multitask is not None and (
        options["multitask_space"] == "features"
    ):
        raise ValueError(
            "`micro_batches` and `multitask_space=\"features\"` cannot be "
            "combined yet: the features-space merge needs each task's "
            "gradient over the representation of the whole batch. Received: "
            f"micro_batches={micro_batches}, multitask={multitask!r}, "
            "multitask_space='features'. Fix: use `accumulation_steps` with "
            "smaller batches, or `multitask_space=\"parameters\"`."
        )
    return {
        "accumulation_steps": _validation.check_accumulation_steps(
            options["accumulation_steps"]
        ),
        "clip_norm": _validation.check_clip_norm(options["clip_norm"]),
        "multitask": multitask,
        "skip_nonfinite": _validation.check_bool(
            "skip_nonfinite", options["skip_nonfinite"]
        ),
        "telemetry": _validation.check_bool("telemetry", options["telemetry"]),
        "micro_batches": micro_batches,
        "max_consecutive_nonfinite": _validation.check_optional_int(
            "max_consecutive_nonfinite", options["max_consecutive_nonfinite"], 1,
            " (dropped micro-batches in a row before training stops) or None",
        ),
        **_validation.check_multitask_space(
            options["multitask_space"], options["multitask_features"], multitask
        ),
    }


def _takes_options(cls):
    """Whether `cls(**config)` reaches `FastGradModel.__init__` with the
    options as keywords (no `__init__` of the subclass's own)."""
    return all(
        "__init__" not in vars(klass)
        for klass in cls.__mro__[: cls.__mro__.index(FastGradModel)]
    )


# Legacy `.h5` files name a model by its bare class name (Keras'
# `model.save("m.h5")` writes `model.__class__.__name__`): the alias lets
# `keras.models.load_model("m.h5")` find the class without `custom_objects`.
keras.saving.get_custom_objects().setdefault("FastGradModel", FastGradModel)


class _Batch(collections.namedtuple("_Batch", [
    "loss", "y_pred", "grads", "x", "y", "sample_weight", "num_samples",
    "normaliser", "divide",
])):
    """What the forward and backward pass of one micro-batch produced.

    `grads` are unscaled (and weighted by the micro-batch's share where
    micro-batches are combined); `normaliser` is the share's denominator
    contribution (`weighting.Share.real`); `divide`: whether the update
    divides the summed gradients by the global normaliser."""


class _Verdict(collections.namedtuple("_Verdict", [
    "checked", "all_finite", "keep", "drops", "counts", "total",
])):
    """The finite check of one micro-batch (global over replicas).

    `checked`: the `finite.marks` vector; `keep`: whether its gradient
    goes on (`all_finite`, or always when nothing is dropped: `drops`);
    `counts`: whether a drop counts towards the divergence streak (`None`:
    it does); `total`: the normaliser summed over replicas."""
