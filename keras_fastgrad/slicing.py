"""In-step micro-batching: one batch, `m` slices, one gradient.

The batch of n samples is padded to `m * s` rows, s = ceil(n / m), and a
`tf.while_loop` runs forward and backward on one slice at a time, adding the
slice's gradient to float32 loop-carried sums: activation memory is that of
one slice. Padded rows get sample weight 0. Keras reduces each slice's loss
as `sum(l * w) / s`, so `s * grad(L_i)` is the slice's sum of per-sample
gradients, and the sums over slices divided by n give exactly the gradient
of the un-split batch, for any n (tests: uneven splits, sample weights, SGD
and Adam, XLA). Weight regularisation enters every slice's loss once; the
`m * s - n` padded rows' share of it is taken back after the loop.

Limits: layers that mix samples (BatchNormalization in training mode) see
slices, not the batch; losses added with `add_loss` inside `call` are
computed per slice.
"""

import tensorflow as tf
from keras.src import tree


def _pad_and_split(t, pad, slices):
    """`[n, ...]` -> `[slices, s, ...]`, zero-padded at the end."""
    t = tf.convert_to_tensor(t)
    paddings = [[0, pad]] + [[0, 0]] * (len(t.shape) - 1)
    padded = tf.pad(t, paddings)
    return tf.reshape(padded, tf.concat([[slices, -1], tf.shape(t)[1:]], 0))


def _slice_weights(sample_weight, mask, pad, slices):
    """Sample weights of the padded slices (0 on padded rows)."""
    if sample_weight is None:
        return _pad_and_split(mask, 0, slices)

    def one(w):
        w = tf.cast(w, mask.dtype)
        w = _pad_and_split(w, pad, slices)
        expand = [slices, -1] + [1] * (len(w.shape) - 2)
        return w * tf.reshape(_pad_and_split(mask, 0, slices), expand)

    return tree.map_structure(one, sample_weight)


def sliced_gradients(model, x, y, sample_weight, variables, scaling, slices, replicas):
    """Forward and backward of `model` on `slices` slices of one batch.

    Args:
        model: The `FastGradModel` (uses its `_compute_loss` and `call`).
        x, y, sample_weight: The batch, as Keras unpacks it.
        variables: The trainable variables the tape watches.
        scaling: The step's `LossScaling` unit.
        slices: Python int >= 2.
        replicas: Number of replicas in sync (Keras divides losses by it).

    Returns:
        `(loss, y_pred, grads)`: the batch loss as Keras would compute it on
        the whole batch, the predictions for the whole batch, and the float32
        gradients multiplied by n * replicas (the step's sample weighting;
        `None` where a variable gets no gradient).
    """
    first = next(t for t in tree.flatten(x) if t is not None)
    n = tf.shape(first)[0]
    size = (n + slices - 1) // slices
    pad = size * slices - n
    mask = tf.concat([tf.ones([n]), tf.zeros([pad])], 0)
    xs = tree.map_structure(lambda t: _pad_and_split(t, pad, slices), x)
    ys = None if y is None else tree.map_structure(lambda t: _pad_and_split(t, pad, slices), y)
    ws = _slice_weights(sample_weight, mask, pad, slices)
    weight = tf.cast(size * replicas, tf.float32)
    out_spec = model.compute_output_spec(tree.map_structure(lambda t: t[0], xs))
    has_grad = []

    def body(i, sums, loss_sum, outputs):
        xi = tree.map_structure(lambda t: t[i], xs)
        yi = None if ys is None else tree.map_structure(lambda t: t[i], ys)
        wi = tree.map_structure(lambda t: t[i], ws)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            for v in variables:
                tape.watch(v.value)
            y_pred = model(xi, training=True) if model._call_has_training_arg else model(xi)
            loss = model._compute_loss(
                x=xi, y=yi, y_pred=y_pred, sample_weight=wi, training=True
            )
            scaled = scaling.scale(loss, weight)
        grads = scaling.unscale(tape.gradient(scaled, [v.value for v in variables]), weight)
        if not has_grad:  # trace-time fact, the same for every slice
            has_grad.extend(g is not None for g in grads)
        sums = [
            total if g is None else total + tf.cast(g, tf.float32)
            for total, g in zip(sums, grads)
        ]
        outputs = [ta.write(i, p) for ta, p in zip(outputs, tree.flatten(y_pred))]
        return i + 1, sums, loss_sum + tf.cast(loss, tf.float32) * tf.cast(size, tf.float32), outputs

    sums = [tf.zeros(v.shape, tf.float32) for v in variables]
    outputs = [
        tf.TensorArray(spec.dtype, size=slices, element_shape=None)
        for spec in tree.flatten(out_spec)
    ]
    _, sums, loss_sum, outputs = tf.while_loop(
        lambda i, *_: i < slices,
        body,
        (tf.constant(0), sums, tf.constant(0.0), outputs),
        maximum_iterations=slices,
    )
    grads = [s if present else None for s, present in zip(sums, has_grad)]
    loss_sum, grads = _take_back_padded_regularization(
        model, variables, grads, loss_sum, pad, replicas
    )
    y_pred = tree.pack_sequence_as(
        out_spec,
        [_merge_slices(ta.stack(), n) for ta in outputs],
    )
    return loss_sum / tf.cast(n, tf.float32), y_pred, grads


def _merge_slices(stacked, n):
    """`[slices, s, ...]` -> `[n, ...]`."""
    flat = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))
    return flat[:n]


def _take_back_padded_regularization(model, variables, grads, loss_sum, pad, replicas):
    """Each slice's loss held the weight regularisation once, weighted by the
    slice size: `pad` padded rows' worth of it is too much."""
    regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return loss_sum, grads
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        for v in regularized:
            tape.watch(v.value)
        penalty = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
    reg_grads = dict(zip((id(v) for v in regularized), tape.gradient(penalty, [v.value for v in regularized])))
    surplus = tf.cast(pad, tf.float32)
    grads = [
        g if id(v) not in reg_grads or g is None else g - surplus * reg_grads[id(v)]
        for v, g in zip(variables, grads)
    ]
    return loss_sum - surplus * penalty / replicas, grads


def check_micro_batches(value):
    """`micro_batches` must be an integer >= 1."""
    from keras_fastgrad._validation import check_int

    return check_int(
        "micro_batches", value, 1, " (slices of each batch, run one after the other)"
    )

