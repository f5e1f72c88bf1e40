"""Exact gradient accumulation over a window of micro-batches.

Keras reduces a loss as `S / D` (`keras_fastgrad.step.weighting`: `D` is the
number of loss elements, of valid ones under a mask, or the sum of sample
weights), so the gradient of the concatenated window is

    g = sum_j (D_j / N) g_j,    N = sum_j D_j,

(`g = sum_j g_j` for `reduction="sum"`). The accumulator keeps
`sum_j D_j g_j` and `N` in float32 variables (model state, saved with the
model) and the step divides once, at the update. A micro-batch left out
(non-finite) adds neither to the sum nor to `N`. A window whose `N` is 0
(every sample weight 0, every position masked) still makes an update, with
a zero gradient, as Keras does on the big batch (its loss is
`divide_no_nan(S, D)`): the window counts its included micro-batches, and
only a window without any (all dropped, or empty) is not applied. Sparse gradients
(`tf.IndexedSlices`) are added to their rows only (without a strategy; under
one the per-replica sums support no `scatter_add`: added densely).

Under a `tf.distribute` strategy each replica adds its own share to
sync-on-read sums: micro-steps do not all-reduce gradients; the update sums
the window once (`replica_sum`), and a checkpoint reads the total.
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.step.gradients import to_float32
from keras_fastgrad.step.variables import add_into, global_variable, increment, run_time_zeros


class WindowAccumulator:
    """Normaliser-weighted sum of micro-batch gradients over `steps` batches.

    Args:
        steps: Integer >= 2, micro-batches per optimizer update.

    Example:

    >>> v = keras.Variable([0.0, 0.0])
    >>> acc = WindowAccumulator(steps=2)
    >>> acc.build([v])
    >>> _ = acc.add([tf.constant([4.0, 4.0])], 4.0, tf.constant(True))
    >>> done = acc.add([tf.constant([8.0, 8.0])], 2.0, tf.constant(True))
    >>> total = acc.window_gradient()[0]  # (4*1 + 2*4) / 6
    >>> bool(done), total.numpy().tolist()
    (True, [2.0, 2.0])
    """

    def __init__(self, steps):
        self.steps = steps
        self.sums = []
        self.normaliser = None
        self.micro_step = None
        # Trace-time fact of the loss (its reduction), recorded by `add`
        # and read by `window_gradient`: the same for the model's life.
        self.mean_reduction = True

    def build(self, variables):
        """Creates the float32 state for the given trainable variables."""
        self.sums = [
            compat.variable(
                keras.ops.zeros(v.shape, "float32"),
                trainable=False,
                autocast=False,
                synchronization="on_read",  # per replica, summed when read
                aggregation="sum",
                name=f"accumulated_{i}",
            )
            for i, v in enumerate(variables)
        ]
        # Global values, the same on every replica.
        self.normaliser = global_variable(0.0, "accumulated_normaliser")
        # int64 on TensorFlow; int32 on JAX, whose 64-bit types are off by
        # default (an int64 variable is stored as int32 there, and every
        # stateless call warned so). A file converts either way on loading.
        counter = "int32" if keras.backend.backend() == "jax" else "int64"
        self.micro_step = global_variable(0, "micro_step", dtype=counter)
        self.included = global_variable(0, "included_micro_batches", dtype=counter)

    @property
    def variables(self):
        """The state, in the order it is saved (`included` last: files
        saved before it existed lack only that one)."""
        return self.sums + [self.normaliser, self.micro_step, self.included]

    def add(self, weighted_grads, normaliser, include, mean_reduction=True, otherwise=None):
        """Adds one micro-batch; returns whether its window is now complete.

        Args:
            weighted_grads: List of float32 gradients already multiplied by
                this replica's loss normaliser `D_j` (the step folds the
                factor into the loss, for free); `None` where a variable has
                none.
            normaliser: float32 scalar, the micro-batch's `D_j` summed over
                all replicas.
            include: boolean scalar, the same on every replica; `False`
                leaves the micro-batch out; the Python `True` (nothing is
                ever left out) adds it without a `cond`.
            mean_reduction: Python bool, whether the window's gradient is
                its sums divided by the normaliser (`False`: a `"sum"`
                loss, the sums themselves).
            otherwise: Optional callable run (no arguments) in the `cond`
                branch of a left-out micro-batch: bookkeeping for free.
                Without a strategy only: under one (one replica too), state
                written there would need a `merge_call` inside the `cond`.

        Returns:
            Boolean scalar: `True` on the window's last micro-batch when
            the window holds an included one (a window of only left-out
            micro-batches is not applied).
        """

        sparse_ok = not tf.distribute.has_strategy()  # sums are plain variables
        self.mean_reduction = mean_reduction

        def add():
            self._add_to_sums(weighted_grads, sparse_ok)

        # A `cond`, not a multiplication by 0 (NaN * 0 is NaN) nor a
        # `where` (an extra pass over every gradient). Mirrored state is
        # written outside it: under a strategy that write is a `merge_call`.
        def leave_out():
            if otherwise is not None:
                otherwise()

        if include is True:
            self._add_included(weighted_grads, normaliser, sparse_ok)
        else:
            tf.cond(include, add, leave_out)
            increment(self.normaliser, tf.where(include, normaliser, 0.0))
            increment(self.included, tf.cast(include, tf.int64))
        self._count(weighted_grads, normaliser, include)
        complete = tf.equal(self.micro_step % self.steps, 0)
        if include is True:  # its last micro-batch is in it: no read
            return complete
        return tf.logical_and(complete, self.has_samples())

    def add_or_apply(self, weighted_grads, normaliser, apply, mean_reduction=True):
        """Adds one micro-batch that is never left out, in the form of
        Keras' `gradient_accumulation_steps`: one `cond` on whether it is
        the window's last. If it is, `apply(window_gradient)` runs with
        this micro-batch added to the sums as they are read (the sums are
        not written with it) and the window empties; if not, it is added
        to the sums. The sums are then written only once the whole
        gradient exists (the `cond`'s inputs), not beside the backward
        pass, and the update step writes none (measured once, the old and
        this form side by side on the benchmark MLP: 1-3% faster;
        docs/benchmarks.md, "sixth run").

        Without a strategy, and dense gradients only (`add` otherwise:
        under a strategy the update leaves replica context before its
        `cond`, `applying.apply_if`; sparse sums are added to their rows).

        Args:
            weighted_grads: As for `add` (dense or `None`).
            normaliser: As for `add`.
            apply: Callable taking the window's gradient (a list, `None`
                where a variable has no gradient): the update.
            mean_reduction: As for `add`.

        Example:

        >>> v = keras.Variable([0.0])
        >>> acc = WindowAccumulator(steps=2)
        >>> acc.build([v])
        >>> applied = []
        >>> acc.add_or_apply([tf.constant([4.0])], 4.0, applied.append)
        >>> acc.add_or_apply([tf.constant([8.0])], 2.0, applied.append)
        >>> applied[0][0].numpy().tolist(), float(acc.normaliser.numpy())  # (4 + 8) / 6
        ([2.0], 0.0)
        """
        self.mean_reduction = mean_reduction
        last = tf.equal((self.micro_step + 1) % self.steps, 0)

        def apply_window():
            window = [
                None if g is None else tf.convert_to_tensor(total.value) + to_float32(g)
                for total, g in zip(self.sums, weighted_grads)
            ]
            if mean_reduction:
                window = _divided(window, tf.convert_to_tensor(self.normaliser) + normaliser)
            apply(window)
            self.reset()

        def add():
            self._add_included(weighted_grads, normaliser, sparse_ok=False)

        tf.cond(last, apply_window, add)
        self._count(weighted_grads, normaliser, True)

    def _add_included(self, weighted_grads, normaliser, sparse_ok):
        """Adds an included micro-batch: its sums, normaliser and count."""
        self._add_to_sums(weighted_grads, sparse_ok)
        increment(self.normaliser, normaliser)
        increment(self.included, tf.constant(1, tf.int64))

    def _add_to_sums(self, weighted_grads, sparse_ok):
        """Adds the gradients to the sums (`sparse_ok`: an `IndexedSlices`
        to its rows only)."""
        for total, g in zip(self.sums, weighted_grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices) and sparse_ok:
                total.value.scatter_add(to_float32(g))  # touched rows only
            else:  # sync-on-read (replica) sums have no `scatter_add`
                add_into(total, tf.cast(tf.convert_to_tensor(g), tf.float32))

    def _count(self, weighted_grads, normaliser, include):
        """Counts the micro-step, once the micro-batch exists. On data of
        unknown size Keras' train function asks the iterator for one batch
        more than it has (`get_next` fails with `OutOfRange`, which ends the
        epoch); TensorFlow inlines the step into that function, and an
        increment that reads nothing of the batch would still run there:
        the window would count a micro-batch that never came."""
        with tf.control_dependencies(_of_the_batch(weighted_grads, normaliser, include)):
            increment(self.micro_step, tf.constant(1, tf.int64))

    def has_samples(self):
        """Boolean scalar: the window holds an included micro-batch (its
        normaliser may be 0: then the update's gradient is 0, as Keras'
        on the big batch)."""
        return self.included > 0

    def window_gradient(self, grads_template=None):
        """The window's gradient: `sum_j D_j g_j / sum_j D_j` (the sums
        themselves for a `"sum"` loss). A normaliser of 0 gives 0, as
        Keras' `divide_no_nan` reduction does on the big batch.

        Args:
            grads_template: As for `window_sums`.
        """
        sums = self.window_sums(grads_template)
        if not self.mean_reduction:
            return sums
        return _divided(sums, tf.convert_to_tensor(self.normaliser))

    def window_sums(self, grads_template=None):
        """`sum_j n_j g_j` over the window: in cross-replica context the
        sync-on-read sums are reduced over the replicas when read.

        Args:
            grads_template: Optional list; where its entry is `None` the
                result is `None` too (variables that never get a gradient).
        """
        template = grads_template or self.sums
        return [
            None if t is None else tf.convert_to_tensor(total.value)
            for total, t in zip(self.sums, template)
        ]

    def reset(self):
        """Empties the window's sums (the micro-step count runs on)."""
        for total in self.sums:
            total.assign(run_time_zeros(total.shape))
        self.normaliser.assign(0.0)
        self.included.assign(0)

    def restart(self):
        """Empties the window and starts the next one at micro-step 0."""
        self.reset()
        self.micro_step.assign(0)


def _divided(sums, normaliser):
    """`sums / normaliser` (`None` kept), 0 where the normaliser is 0, as
    Keras' `divide_no_nan` reduction gives on the big batch."""
    inverse = tf.math.divide_no_nan(1.0, normaliser)
    return [None if g is None else g * inverse for g in sums]


def _of_the_batch(weighted_grads, normaliser, include):
    """Tensors computed from the micro-batch (its gradients, normaliser and
    verdict): what the window's count waits for (`add`)."""
    tensors = [normaliser, include]
    for g in weighted_grads:
        if isinstance(g, tf.IndexedSlices):
            tensors.append(g.values)
        elif g is not None:
            tensors.append(g)
    return [t for t in tensors if isinstance(t, tf.Tensor)]
