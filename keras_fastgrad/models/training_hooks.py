"""`TrainingHooks`, a base class of `FastGradModel`: its overrides of the
Keras methods around training (building before the first step, `fit`,
`evaluate`, the end of an epoch, loading, the variables Keras threads on
JAX), each a few lines calling the work in `models/_keras_hooks.py` or the
backend's shell (`backend.shell()`).
"""

from keras_fastgrad import _compat as compat
from keras_fastgrad import backend as _backend
from keras_fastgrad.models import _keras_hooks as integration


class TrainingHooks:
    """The Keras hooks around `FastGradModel`'s training (as Keras' `Model`
    inherits its `Trainer`): every method calls `super()`'s, so this class
    comes before `keras.Model` among the model's bases."""

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
            self.fastgrad_step_state.kept_arrays = _backend.shell().arrays_kept_for_a_refusal(self)

    def fit(self, *args, **kwargs):
        shell = _backend.shell()
        args, kwargs = shell.with_divergence_stop(self, args, kwargs)
        state = self.fastgrad_step_state
        state.in_fit = True
        # JAX: the arrays Keras' fit detaches, kept until the first step is
        # traced (`train_step` drops them): a refusal raised while tracing
        # leaves the model its weights. (TensorFlow: `None`.)
        state.kept_arrays = shell.arrays_kept_for_a_refusal(self)
        try:
            return super().fit(*args, **kwargs)
        except BaseException:
            compat.reattach(state.kept_arrays or [])
            raise
        finally:
            state.kept_arrays = None
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
        # (`model.weights` and the files' layout stay those of TensorFlow).
        return super().non_trainable_variables + _backend.shell().step_variables(self)
