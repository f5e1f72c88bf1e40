"""One side of a ratio: a model's compiled train step as a function that
times each step (`step_fn` on TensorFlow, `jax_step_fn` on JAX) and the
synthetic data the benchmarks feed it. `harness` interleaves two sides and
writes the report."""

import time

import numpy as np


def step_fn(model, dataset, steps, callbacks=()):
    """A function that runs `steps` train steps of `model`
    (its compiled `train_function`, as `fit` calls it, without `fit`'s own
    per-epoch and per-batch Python work) on batches of the repeating
    `dataset` and returns each step's seconds (`run(count)`: `count`
    steps instead; `run.steps`: `steps`). Built by one `fit` epoch
    of two batches with `callbacks` (what they put into the compiled step
    is timed; their per-batch Python work in `fit` is not), traced here
    (warm-up). Under a distribution strategy the batches are distributed
    as `fit` does."""
    import tensorflow as tf

    model.fit(dataset.take(2), epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))
    function = model.train_function  # what that `fit` made
    if tf.config.list_physical_devices("GPU"):  # time each step to its end
        function = synced(function)
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync > 1:
        iterator = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
    else:
        iterator = iter(dataset.repeat())
    for _ in range(steps):
        function(iterator)

    def run(count=None):
        seconds = []
        for _ in range(steps if count is None else count):
            start = time.perf_counter()
            function(iterator)
            seconds.append(time.perf_counter() - start)
        return seconds

    run.steps = steps
    return run


def jax_step_fn(model, x, y, batch, steps):
    """`step_fn` on Keras' JAX backend: a function that runs
    `steps` train steps of `model` (its jitted `train_function`, the state
    threaded as `fit` threads it) on the batches of `x`, `y` and returns
    each step's seconds (`run(count)`, `run.steps`: as `step_fn`'s), each
    step timed until its outputs and state are
    ready (`jax.block_until_ready`: JAX dispatches asynchronously). Built
    and traced by one short `fit`."""
    import jax

    model.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, epochs=1, verbose=0)
    batches = [
        (jax.numpy.asarray(x[i : i + batch]), jax.numpy.asarray(y[i : i + batch]))
        for i in range(0, len(x) - batch + 1, batch)
    ]
    return jax_timed_steps(model, batches, steps)


def jax_timed_steps(model, batches, steps):
    """After a `fit` built and traced `model`'s JAX `train_function`: a
    function timing its calls on `batches` in turn (the state threaded as
    `fit` threads it), each until its outputs and state are ready, after
    `steps` warm-up calls; `run(count)`, `run.steps` as `step_fn`'s."""
    import jax

    function = model.train_function
    state = [jax_state(model)]

    def step(i):
        logs, state[0] = function(state[0], iter([batches[i % len(batches)]]))
        jax.block_until_ready((logs, state[0]))

    for i in range(steps):  # warm-up (a first call may trace again)
        step(i)

    done = [steps]  # steps run so far: the next batch

    def run(count=None):
        seconds = []
        for _ in range(steps if count is None else count):
            start = time.perf_counter()
            step(done[0])
            seconds.append(time.perf_counter() - start)
            done[0] += 1
        return seconds

    run.steps = steps
    return run


def jax_state(model):
    """The state `fit` hands a JAX train function: the values of `model`'s
    trainable, non-trainable, optimizer and metrics variables."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )


def synced(function):
    """`function`, returning only once the step has run on the device (it
    reads the loss, as `fit` does when it hands logs to a callback);
    idempotent."""
    import tensorflow as tf

    if getattr(function, "synced", False):
        return function

    def run(iterator):
        logs = function(iterator)
        loss = logs.get("loss") if isinstance(logs, dict) else None
        (tf.nest.flatten(logs)[0] if loss is None else loss).numpy()
        return logs

    run.synced = True
    return run


def dataset_of(x, y, batch):
    """`x, y` as a `tf.data.Dataset` of whole batches (for `step_fn`)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def synthetic(shape, classes, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y
