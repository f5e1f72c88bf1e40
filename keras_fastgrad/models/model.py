"""`FastGradModel`: a `keras.Model` whose train step owns the gradient path.

The step reads as a chain of small units (`keras_fastgrad.step.train_step`), each
calling the module that does its maths:

    forward + loss (`_forward`: the tape watches only the trainable variables)
      -> share of the window (`weighting`) -> unscale (`loss_scaling`)
      -> [multi-task] merge (`multitask`, `feature_space`)
      -> finite check (`finite`) -> accumulate (`accumulation`)
      -> clip (`clipping`) -> apply (`applying`)

and records what it measured in `telemetry`. Its state is one object,
`StepState` (`model.fastgrad_step_state`), passed to every unit. This
module holds the class: the options (checked by `models/options.py`),
`train_step` (it orchestrates; no maths) and the Keras hooks, each method
delegating to the module of its concern: `models/_keras_hooks.py` (Keras'
building, compiling, cloning and flushing), `models/config.py` (the
options in the config), `models/readouts.py` (what the step measured),
`models/partial_window.py` (`apply_partial_window`).
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad import aggregators
from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration
from keras_fastgrad.models import config as model_config
from keras_fastgrad.models import options as _options
from keras_fastgrad.models import own_step, partial_window, readouts
from keras_fastgrad.step.loss_scaling import LossScaling
from keras_fastgrad.step.options import StepOptions
from keras_fastgrad.step.state import StepState
from keras_fastgrad.step.task_losses import check_task_count
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION, LOG_KEYS

# The backend's shell (`keras_fastgrad.backend.tensorflow.trainer` or
# `keras_fastgrad.backend.jax.trainer`), picked once as Keras' `Model` picks
# its trainer: every method below that differs by backend calls it.
_shell = _backend.shell()


@keras.saving.register_keras_serializable(package="keras_fastgrad")
class FastGradModel(keras.Model):
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
        clip_adaptive: Float > 0 or `None` (default). Adaptive gradient
            clipping (AGC, Brock et al. 2021), `lambda`: each unit's
            gradient (an output unit of a kernel, a row of an embedding
            table, a whole bias) is scaled to at most `clip_adaptive *
            max(||w||, clip_adaptive_eps)`, its weights' norm. Applied once
            to each update's final gradient (after accumulation, unscaling
            and the sum over replicas), before `clip_norm` (see
            `keras_fastgrad.step.adaptive_clipping`).
        clip_adaptive_eps: Float > 0, defaults to `1e-3`. AGC's `eps`: the
            smallest weight norm a unit is measured by (zero-initialised
            weights can still move). Needs `clip_adaptive`.
        multitask: `None` (default): the task losses are summed as in
            `keras.Model`. Or a multi-task method: a name from
            `keras_fastgrad.aggregators.NAMES` (`"sum"`, `"mean"`,
            `"pcgrad"`, `"mgda"`, `"cagrad"`, `"imtl"`, `"aligned"`,
            `"upgrad"`, `"dualproj"`, `"config"`, `"nashmtl"`,
            `"gradvac"`) or an `Aggregator` instance. Each compiled output loss (times its
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
            their plain gradients (see `keras_fastgrad.multitask.feature_space`).
        multitask_features: `None` (default) or a layer name, with
            `multitask_space="features"`: the layer whose output is `Z`.
            `None` finds `Z` in a functional model (the deepest tensor all
            outputs depend on); a subclassed model must name it.
        skip_nonfinite: Boolean, defaults to `True`. A micro-batch whose loss
            or gradient holds NaN/Inf is dropped: it never touches the
            weights or the optimizer state, it is left out of its window's
            normalisation and counted (`nonfinite_count`). `False` applies
            such gradients like `keras.Model` does, without a check (counted
            only while a `nonfinite_*` key is requested: `telemetry=True`,
            `NonFiniteGuard`); a loss-scaled model still drops them: loss
            scaling needs it.
        micro_batches: Integer >= 1, defaults to `1`. Splits each batch into
            this many slices (as `numpy.array_split` splits it) inside the
            step, which runs forward and backward on one slice after the
            other: one update per batch, equal to the un-split step, with
            the activation memory of one slice (see
            `keras_fastgrad.step.slicing`). With `multitask`, the task
            gradients are summed over the slices and merged once.
        max_consecutive_nonfinite: Integer >= 1 or `None`, defaults to
            `10`. A run that drops this many micro-batches in a row (no
            update applied in between; loss-scale overflows that halving
            the scale can fix do not count) has diverged: `fit` stops with
            a `RuntimeWarning`. Periods in which nothing was kept, or that
            end while micro-batches are being dropped, log `loss=nan`, so
            best-checkpoint callbacks never pick them (see
            `keras_fastgrad.step.divergence`). `None` never stops.
        batchnorm_statistics: `"window"` (default) or `"micro_batch"`.
            How `BatchNormalization` layers move their moving mean and
            variance when a batch is split (`accumulation_steps`,
            `micro_batches`). `"window"`: once per update, from the moments
            pooled over the window's micro-batches (and replicas), as
            `keras.Model` on the concatenated batch (the forward pass still
            normalises by each micro-batch's moments: ghost batch norm).
            `"micro_batch"`: once per micro-batch, from its own moments
            (the behaviour before this option). See
            `keras_fastgrad.step.batchnorm`.
        telemetry: Boolean, defaults to `False`. Adds the step's measurements
            (`grad_norm`, `nonfinite_count`, `loss_scale`, ... see
            `keras_fastgrad.step.telemetry.LOG_KEYS`) to the logs. The callbacks
            of `keras_fastgrad.callbacks` switch it on when attached.
        *args: Passed to `keras.Model`.
        **kwargs: Passed to `keras.Model`.

    Raises:
        ValueError, TypeError: on invalid options, naming the option, the
            rule and the value received. `compile` raises `ValueError` if
            the optimizer also accumulates or clips while the model does
            (before Keras compiles). `fit` raises `ValueError` when a
            subclass's own `train_step` never calls this class's (which is
            where the options act) while an option is set: see
            `keras_fastgrad.models.own_step`.

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
        clip_adaptive=None,
        clip_adaptive_eps=1e-3,
        multitask=None,
        skip_nonfinite=True,
        telemetry=False,
        micro_batches=1,
        max_consecutive_nonfinite=10,
        multitask_space="parameters",
        multitask_features=None,
        batchnorm_statistics="window",
        **kwargs,
    ):
        # Options saved by `get_config` under `fastgrad_options` (a subclass
        # with its own `__init__`), or left by `__new__` for a clone made by
        # `keras.models.clone_model`: the trained model's options win.
        restored = kwargs.pop("fastgrad_options", None)
        restored = vars(self).pop("_fg_cloned_options", None) or restored
        _options.check_keyword_names(
            kwargs,
            OPTION_NAMES,
            model_config.keras_keywords(type(self), FastGradModel),
            owner=type(self).__name__,
        )
        given = {
            "accumulation_steps": accumulation_steps,
            "clip_norm": clip_norm,
            "clip_adaptive": clip_adaptive,
            "clip_adaptive_eps": clip_adaptive_eps,
            "multitask": multitask,
            "skip_nonfinite": skip_nonfinite,
            "telemetry": telemetry,
            "micro_batches": micro_batches,
            "max_consecutive_nonfinite": max_consecutive_nonfinite,
            "multitask_space": multitask_space,
            "multitask_features": multitask_features,
            "batchnorm_statistics": batchnorm_statistics,
        }
        options = _checked_options(**{**given, **(restored or {})})
        if compat.functional_init_arguments(args, kwargs) and not isinstance(
            self, keras.Sequential
        ):
            if not isinstance(self, compat.Functional):
                # `super().__init__(inputs=..., outputs=...)` from a
                # subclass's `__init__`: Keras would rewrite the bases of
                # every class up to `keras.Model` (and so break every later
                # subclassed `FastGradModel`); this instance gets the
                # class's functional variant instead.
                self.__class__ = integration.functional_variant(type(self))
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
        # Saved as its own entry of `.keras` / `.weights.h5` files.
        self.fastgrad_step_state = StepState(self)
        self._fg_set_options(options)

    def _fg_set_options(self, options):
        """Sets the (checked) constructor options on the model."""
        for name, value in options.items():
            setattr(self, name, value)
        merger = None
        if self.multitask is not None:
            # Imported with the method: a single-task model never needs it.
            from keras_fastgrad.multitask import TaskMerger

            merger = TaskMerger(self.multitask)
        self.fastgrad_step_state.configure(StepOptions.of(type(self), options), merger)
        if self.telemetry and self.clip_adaptive is not None:
            self.fastgrad_step_state.log_keys.add(AGC_CLIPPED_FRACTION)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A `train_step` of the subclass's own that never calls this one
        # would silently ignore the options: refused (see `own_step`).
        step = vars(cls).get("train_step")
        if step is not None and not getattr(step, "_fg_guarded", False):
            cls.train_step = own_step.guard(step, _DEFAULT_OPTIONS)

    # ------------------------------------------------------------ compile/fit
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        # Refused before Keras compiles: a refusal leaves the model as it was.
        optimizer = keras.optimizers.get(optimizer)
        _options.check_optimizer_ownership(optimizer, self.accumulation_steps, self.clip_norm)
        super().compile(optimizer, *args, **kwargs)
        try:
            self._fg_after_compile()
        except Exception:
            # Refused after Keras compiled (the task count needs the
            # compiled losses): `fit` asks for a `compile` that passes.
            self.compiled = False
            raise

    def _fg_after_compile(self):
        """What the step needs of a compiled model (also for a model
        compiled before `fastgrad` gave it the step)."""
        check_compiled(self, self._fg_options())
        # Keras' `loss` tracker, made honest about dropped micro-batches
        # (set as Keras' `compile` sets it: not tracked as a user metric).
        tracker = _shell.loss_tracker(self.fastgrad_step_state.streak)
        compat.set_loss_tracker(self, tracker)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        return _shell.make_train_function(self, super().make_train_function, force)

    def _fg_prepare_state(self):
        """The step's state for the model as it trains now (its trainable
        variables, its optimizer): before the train function is traced,
        and before a flush that comes first (a loaded or recompiled model)."""
        state = self.fastgrad_step_state
        state.build(self)
        if not self.optimizer.built:  # state must exist before tracing
            self.optimizer.build(self.trainable_variables)
        state.scaling = LossScaling(self.optimizer)
        state.flush_function = None

    def apply_partial_window(self):
        """Applies the accumulated gradient of an incomplete window now.

        `fit` calls this at the end of every epoch. Call it yourself after a
        loop of `train_on_batch` calls. Does nothing without accumulation or
        when the window is empty. A window saved pending (`model.save`,
        `save_weights`) is applied after loading as it would have been
        before saving, with the model's optimizer now.

        Returns:
            The telemetry logs (Python floats) after the flush, or `None`
            when nothing was pending.

        Raises:
            ValueError: when a window is pending and the model has no
                optimizer (loaded with `compile=False`).
        """
        return partial_window.apply_partial_window(self)  # either backend

    # ------------------------------------------------------------- the step
    def train_step(self, data, *jax_batch):
        """One micro-batch through the chain (`keras_fastgrad.step.train_step`):

        gradients (forward, backward, unscale, task merge) -> finite check
          -> [BatchNorm pooled] the micro-batch's moments into the window
          -> loss-scale update
          -> [one replica, no accumulation] update or drop, in one `cond`
          -> [else] accumulate -> [window complete] clip, check, apply

        then Keras' loss tracker and metrics, and the telemetry keys. A
        micro-batch whose loss or gradient is not finite is dropped (with
        `skip_nonfinite`, or under loss scaling) and counted instead.

        On Keras' JAX backend Keras calls `train_step(state, data)`: the
        same chain on the state tuple (`keras_fastgrad.backend.jax.step`).
        """
        own_step.note_base_step(self)  # a subclass's own step called this one
        return _shell.train_step(self, data, *jax_batch)

    # ---------------------------------------------- Keras hooks (_keras_hooks)
    def __new__(cls, *args, **kwargs):
        # Like `keras.Model.__new__`, but the functional form is an instance
        # of a class that also inherits from `Functional`: this class's
        # bases never change.
        functional = integration.is_functional_call(cls, args, kwargs)
        if functional and not issubclass(cls, compat.Functional):
            cls = integration.functional_variant(cls)
        instance = super().__new__(cls, *args, **kwargs)
        if functional:  # read (and removed) by `__init__`
            options = integration.cloned_options(compat.caller_frame(1), FastGradModel)
            if options is not None:
                vars(instance)["_fg_cloned_options"] = options
        return instance

    def __reduce__(self):
        # Keras pickles a model as its `.keras` bytes plus the class's
        # `_unpickle_model`, which pickle finds by the class's name; the
        # functional variants and `fastgrad`'s classes share their name with
        # another class. Loading goes by the file's registered names anyway.
        _, args = super().__reduce__()
        return (compat.unpickle_model_function(FastGradModel), args)

    def compile_from_config(self, config):
        if type(self).compile is not FastGradModel.compile:  # a subclass's own
            return super().compile_from_config(config)
        integration.compile_from_config(self, config)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if not integration.builds_itself(self):
            super()._maybe_symbolic_build(iterator, data_batch)
        else:
            integration.build_for_training(self, iterator, data_batch)
        self._fg_keep_for_a_refusal()

    def _fg_keep_for_a_refusal(self):
        """In a JAX `fit` until its first step is traced: the arrays of every
        variable of the state tuple built so far (`fit`'s `except` gives
        them back if tracing raises)."""
        if self.fastgrad_step_state.kept_arrays is not None:
            self.fastgrad_step_state.kept_arrays = _shell.arrays_kept_for_a_refusal(self)

    def fit(self, *args, **kwargs):
        args, kwargs = _shell.with_divergence_stop(self, args, kwargs)
        state = self.fastgrad_step_state
        state.in_fit = True
        # JAX: the arrays Keras' fit detaches, kept until the first step is
        # traced (`train_step` drops them): a refusal raised while tracing
        # leaves the model its weights. (TensorFlow: `None`.)
        state.kept_arrays = _shell.arrays_kept_for_a_refusal(self)
        try:
            return super().fit(*args, **kwargs)
        except BaseException:
            compat.reattach(self.fastgrad_step_state.kept_arrays or [])
            raise
        finally:
            self.fastgrad_step_state.kept_arrays = None
            state.in_fit = False

    def evaluate(self, *args, **kwargs):
        state = self.fastgrad_step_state
        state.evaluating += 1
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            state.evaluating -= 1

    def _get_metrics_result_or_logs(self, logs):
        # Keras calls this right after an epoch's last batch, before
        # validation and `on_epoch_end` (and at the end of `evaluate`).
        logs = integration.with_flushed(self, logs)
        return super()._get_metrics_result_or_logs(logs)

    def load_own_variables(self, store):
        # Files written before the step's state had an entry of its own
        # kept it in the model's entry, as `fastgrad_<i>`: still read.
        keys = list(store.keys())
        super().load_own_variables({k: store[k] for k in keys if not k.startswith("fastgrad_")})
        legacy = [store[f"fastgrad_{i}"] for i in range(len(keys)) if f"fastgrad_{i}" in store]
        if legacy and self.built:
            self.fastgrad_step_state.load_legacy(legacy)

    @property
    def non_trainable_variables(self):
        # On JAX, Keras threads these (and only the four lists) through its
        # stateless step: the step's own variables ride here once built
        # (`model.weights` and the files' layout stay those of TF).
        return super().non_trainable_variables + _shell.step_variables(self)

    # ------------------------------------------------ what the step measured
    @property
    def tape_variable_count(self):
        """Number of variables the tape watched in the traced train step
        (`None` before the first trace). On JAX, which has no tape: the
        number of trainable variables `jax.value_and_grad` differentiates
        (all of them), once the train function is made."""
        return _shell.tape_variable_count(self)

    @property
    def train_step_trace_count(self):
        """How many times `train_step` was traced (retracing shows here)."""
        return self.fastgrad_step_state.trace_count

    @property
    def variables_without_gradient(self):
        """Paths of trainable variables that got no gradient in the traced
        step (unused, or cut off by `stop_gradient`); `None` before the
        first trace. On JAX (where such a variable gets zeros, not `None`)
        they are read from the traced program only while the
        `tape_variables` key is requested (TapeVariableCounter,
        `telemetry=True`); `None` otherwise."""
        return self.fastgrad_step_state.no_gradient

    def layer_norm_keys(self):
        """The `grad_norm/<layer>` keys this model's layers would log."""
        return readouts.layer_norm_keys(self)

    def enable_telemetry(self, keys=LOG_KEYS):
        """Adds telemetry keys to the step's logs (used by the callbacks).

        Args:
            keys: Iterable of names from `keras_fastgrad.LOG_KEYS`.

        Raises:
            ValueError: for a name that is not a telemetry key.

        The train function is rebuilt (retraced) on the next `fit` when the
        set of keys grows.
        """
        keys = list(keys)
        _backend.check_telemetry_keys(keys)  # (JAX: every key is measured)
        readouts.enable_telemetry(self, keys)

    def telemetry_counters(self):
        """The step's cumulative counters now, as Python floats.

        Returns:
            Dict with `updates`, `clipped_updates` and `nonfinite_count`
            (over the model's life; saved with the model). Zeros before the
            step's state exists. Reads three scalars from the device.

        Example:

        >>> inputs = keras.Input((2,))
        >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.telemetry_counters()
        {'updates': 0.0, 'clipped_updates': 0.0, 'nonfinite_count': 0.0}
        """
        return readouts.telemetry_counters(self)

    # ---------------------------------------------------------------- config
    @compat.keras_default  # Keras' automatic config of a subclass's own arguments
    def get_config(self):
        return model_config.with_options(
            super().get_config(), type(self), FastGradModel, self._fg_options()
        )

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The options are set after Keras has built the model from the rest
        # (a subclass's `__init__`, a `Sequential`'s layers, ...).
        config, options = model_config.pop_options(config, cls, FastGradModel, OPTION_NAMES)
        model = super().from_config(config, custom_objects=custom_objects)
        if options and isinstance(model, FastGradModel):
            model._fg_set_options(_checked_options(**{**model._fg_options(), **options}))
        return model

    def _fg_options(self):
        """The constructor's options, serializable (`get_config`, clones)."""
        return model_config.serializable_options(self, OPTION_NAMES)


# The constructor's options and their defaults, read off its signature.
_DEFAULT_OPTIONS = model_config.default_options(FastGradModel)
OPTION_NAMES = tuple(_DEFAULT_OPTIONS)


def check_compiled(model, options):
    """Refuses `options` (`FastGradModel`'s, checked) that do not fit the
    compiled `model`: a concern its optimizer owns too, a multi-task
    method without two task losses. Reads the model only, so `fastgrad`
    refuses before it changes anything."""
    _options.check_optimizer_ownership(
        model.optimizer, options["accumulation_steps"], options["clip_norm"]
    )
    if options["multitask"] is not None:
        check_task_count(model, aggregators.get(options["multitask"]))


def _checked_options(**options):
    """The constructor's options (defaults for those not given),
    validated (Keras-style errors)."""
    options = _options.check_options({**_DEFAULT_OPTIONS, **options})
    _backend.check_options(options, _DEFAULT_OPTIONS)  # JAX: the supported set
    return options


# Legacy `.h5` files name a model by its bare class name (Keras'
# `model.save("m.h5")` writes `model.__class__.__name__`): the alias lets
# `keras.models.load_model("m.h5")` find the class without `custom_objects`.
keras.saving.get_custom_objects().setdefault("FastGradModel", FastGradModel)
