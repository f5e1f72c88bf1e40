"""`FastGradModel`: a `keras.Model` whose train step owns the gradient path.

This module holds the class: its options (checked by `step/option_checks.py`,
kept in the config by `models/config.py`), `compile`, the train function
and `train_step`, which hand the step to the backend's shell
(`keras_fastgrad.backend.shell()`: the chain of `keras_fastgrad.step`'s
units on TensorFlow, `keras_fastgrad.backend.jax.step` on JAX). Its bases
hold the rest: `models/readouts.py` (what the step measured) and
`models/training_hooks.py` (Keras' hooks around training; their work in
`models/_keras_hooks.py`) and `models/saving_hooks.py` (Keras' hooks that
make, save, load, clone and pickle it by its class).
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration
from keras_fastgrad.models import config as model_config
from keras_fastgrad.models import own_step, partial_window
from keras_fastgrad.models.readouts import StepReadouts
from keras_fastgrad.models.saving_hooks import SavingHooks
from keras_fastgrad.models.training_hooks import TrainingHooks
from keras_fastgrad.step import compile_checks, option_checks
from keras_fastgrad.step.options import StepOptions
from keras_fastgrad.step.state import StepState
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION

# The backend's shell (`keras_fastgrad.backend.tensorflow.trainer` or
# `keras_fastgrad.backend.jax.trainer`), picked once as Keras' `Model` picks
# its trainer: every method below that differs by backend calls it.
_shell = _backend.shell()


@keras.saving.register_keras_serializable(package="keras_fastgrad")
class FastGradModel(StepReadouts, TrainingHooks, SavingHooks, keras.Model):
    """A `keras.Model` with exact accumulation, clipping and NaN safety.

    Use it wherever you would use `keras.Model` (functional or subclassed),
    then `compile` and `fit` as usual. With default options it trains
    exactly like `keras.Model`.

    Args:
        accumulation_steps: Integer >= 1, defaults to `1`. Batches
            (micro-batches) per optimizer update. The update equals one
            step on their concatenation (each micro-batch counts by its
            share of the window's samples, sample weights included);
            `optimizer.iterations` counts updates. A window left partial at
            an epoch's end is applied then (`apply_partial_window`).
        clip_norm: Float > 0 or `None` (default). The global L2 norm each
            update's final gradient (after accumulation) is clipped to.
        clip_adaptive: Float > 0 or `None` (default). Adaptive gradient
            clipping's `lambda` (AGC, Brock et al. 2021): each unit's
            gradient (an output unit of a kernel, a row of an embedding, a
            bias) is scaled to at most `clip_adaptive * max(||w||,
            clip_adaptive_eps)`, once per update, after accumulation and
            before `clip_norm` (`keras_fastgrad.step.adaptive_clipping`).
        clip_adaptive_eps: Float > 0, defaults to `1e-3`. AGC's `eps`: the
            smallest weight norm a unit is measured by. Needs
            `clip_adaptive`.
        multitask: `None` (default: the task losses are summed, as in
            `keras.Model`), a name from `keras_fastgrad.aggregators.NAMES`
            (`"sum"`, `"mean"`, `"pcgrad"`, `"mgda"`, `"cagrad"`, `"imtl"`,
            `"aligned"`, `"upgrad"`, `"dualproj"`, `"config"`, `"nashmtl"`,
            `"gradvac"`) or an `Aggregator`. Each compiled output loss (times its loss
            weight) is a task: the task gradients over the shared variables
            are merged by the method, each task's own variables get its
            plain gradient (`keras_fastgrad.multitask`).
        multitask_space: `"parameters"` (default) or `"features"`: where
            `multitask` compares the tasks, the gradients over the shared
            variables or with respect to the shared representation `Z`
            (MGDA-UB: one trunk backward pass of their weighted sum).
        multitask_features: `None` (default) or the name of the layer whose
            output is `Z`, with `multitask_space="features"`. `None` finds
            `Z` in a functional model; a subclassed model must name it.
        skip_nonfinite: Boolean, defaults to `True`. A micro-batch whose
            loss or gradient holds NaN/Inf is dropped (it never touches the
            weights or the optimizer, nor its window's normalisation) and
            counted (`nonfinite_count`). `False` applies it as `keras.Model`
            does; a loss-scaled model still drops it.
        micro_batches: Integer >= 1, defaults to `1`. Slices each batch is
            split into inside the step (as `numpy.array_split` splits it),
            run forward and backward one after the other: one update per
            batch, equal to the un-split step, with the activation memory of
            one slice (`keras_fastgrad.step.slicing`).
        max_consecutive_nonfinite: Integer >= 1 or `None`, defaults to
            `10`. Micro-batches dropped in a row (loss-scale overflows
            excepted) after which `fit` stops with a `RuntimeWarning`;
            periods that kept nothing log `loss=nan`
            (`keras_fastgrad.step.divergence`). `None` never stops.
        batchnorm_statistics: `"window"` (default) or `"micro_batch"`. How
            `BatchNormalization` layers move their moving statistics when a
            batch is split: once per update from the moments pooled over
            the window (as `keras.Model` on the concatenated batch), or once
            per micro-batch from its own (`keras_fastgrad.step.batchnorm`).
        telemetry: Boolean, defaults to `False`. Adds the step's
            measurements (`keras_fastgrad.LOG_KEYS`) to the logs; the
            callbacks of `keras_fastgrad.callbacks` switch it on.
        *args: Passed to `keras.Model`.
        **kwargs: Passed to `keras.Model`.

    Raises:
        ValueError, TypeError: on invalid options, naming the option, the
            rule and the value received; from `compile`, an optimizer that
            also accumulates or clips while the model does; from `fit`, a
            subclass's own `train_step` that never calls this class's while
            an option is set (`keras_fastgrad.models.own_step`).

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
        option_checks.check_keyword_names(
            kwargs,
            OPTION_NAMES,
            model_config.keras_keywords(type(self), FastGradModel),
            owner=type(self).__name__,
        )
        given = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        options = _checked_options(**{**given, **(restored or {})})
        if integration.is_functional_init(self, args, kwargs):
            integration.init_functional(self, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._fg_setup(options)

    def _fg_setup(self, options):
        """The step's options and (empty) state on a Keras-initialised
        model: from `__init__`, or on an existing model (`fastgrad`)."""
        # Saved as its own entry of `.keras` / `.weights.h5` files.
        self.fastgrad_step_state = StepState(self, *_shell.STEP_UNIT_CLASSES)
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
        compile_checks.check_optimizer_ownership(optimizer, self.accumulation_steps, self.clip_norm)
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
        compile_checks.check_compiled(self, self._fg_options())
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
        state.scaling = _shell.LOSS_SCALING(self.optimizer)
        state.flush_function = None

    def apply_partial_window(self):
        """Applies the accumulated gradient of an incomplete window now.

        `fit` calls this at the end of every epoch. Call it yourself after a
        loop of `train_on_batch` calls. Does nothing without accumulation or
        when the window is empty. A window saved pending (`model.save`,
        `save_weights`) is applied after loading as it would have been
        before saving, with the model's optimizer now.

        Returns:
            The telemetry logs (Python floats) after the flush, the same
            keys on both backends: every counter, the optional keys the
            model measures and its `gns_*` keys, never the task keys
            (`step.telemetry.partial_window_keys`); `None` when nothing
            was pending.

        Raises:
            ValueError: when a window is pending and the model has no
                optimizer (loaded with `compile=False`).
        """
        return partial_window.apply_partial_window(self)  # either backend

    # ------------------------------------------------------------- the step
    def train_step(self, data, *jax_batch):
        """One micro-batch through the step, by the backend's shell.

        Takes Keras' arguments for the backend (`data` on TensorFlow,
        `(state, data)` on JAX) and returns what Keras' own `train_step`
        returns there: the logs (with the telemetry keys), and on JAX the
        new state. A micro-batch whose loss or gradient is not finite is
        dropped and counted (with `skip_nonfinite`, or under loss scaling).
        """
        own_step.note_base_step(self)  # a subclass's own step called this one
        return _shell.train_step(self, data, *jax_batch)


# The constructor's options and their defaults, read off its signature.
_DEFAULT_OPTIONS = model_config.default_options(FastGradModel)
OPTION_NAMES = tuple(_DEFAULT_OPTIONS)


def _checked_options(**options):
    """The constructor's options (defaults for those not given),
    validated (Keras-style errors; the backend's refusals)."""
    return option_checks.checked_options(options, _DEFAULT_OPTIONS, _backend.check_options)


# Legacy `.h5` files name a model by its bare class name (Keras'
# `model.save("m.h5")` writes `model.__class__.__name__`): the alias lets
# `keras.models.load_model("m.h5")` find the class without `custom_objects`.
keras.saving.get_custom_objects().setdefault("FastGradModel", FastGradModel)
