"""Spike for issue 29: keras_fastgrad's step units inside Keras' stateless JAX step.

Not part of the package. Run: ``KERAS_BACKEND=jax python prototypes/jax_step/spike.py [time]``
(a venv with keras==3.15.1, jax, numpy). See README.md in this folder for the findings.
"""

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

try:  # the TensorFlow venv times keras.Model and NormRecorder only (`tf time`)
    import jax
except ImportError:
    jax = None

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402


class SpikeModel(keras.Model):
    """Accumulation over `accum` fit steps, finite gate, global-norm clip, on JAX.

    The units (`_units`) are written against Keras variables (`.assign`,
    `keras.ops`); the adapter (`train_step`) takes the gradient and opens a
    `keras.StatelessScope` over the state tuple. `mode` picks how the gated
    optimizer update is expressed: "where" (update always computed, then
    selected), "cond" (`ops.cond` with `.assign` inside, the TF-style way),
    "lax" (adapter-owned `jax.lax.cond` over `optimizer.stateless_apply`).
    """

    def __init__(self, *args, accum=4, clip_norm=None, mode="where", **kwargs):
        super().__init__(*args, **kwargs)
        self.accum, self.clip_norm, self.mode = accum, clip_norm, mode

    def build_step_state(self, in_weights=True):
        # in_weights: `add_weight`, model-tracked, so Keras threads them through the
        # state tuple, but they join `model.weights`. Else: untracked `keras.Variable`s
        # threaded by the `non_trainable_variables` override below; weights unchanged.
        if in_weights:
            new = lambda s: self.add_weight(shape=s, initializer="zeros", trainable=False)  # noqa: E731
        else:
            new = lambda s: keras.Variable(np.zeros(s, "float32"), trainable=False)  # noqa: E731
        own = [*(new(v.shape) for v in self.trainable_variables), new(()), new(())]
        object.__setattr__(self, "_fg_acc", own[:-2])  # not tracked by Keras
        object.__setattr__(self, "_fg_samples", own[-2])
        object.__setattr__(self, "_fg_count", own[-1])
        self._layer_ntv = [v for v in self.non_trainable_variables if id(v) not in map(id, own)]
        object.__setattr__(self, "_fg_extra", [] if in_weights else own)

    @property
    def non_trainable_variables(self):
        return super().non_trainable_variables + getattr(self, "_fg_extra", [])

    # ---- units: backend-neutral, Keras variables and keras.ops only ----
    def _units(self, grads, n, new_layer_ntv):
        opt = self.optimizer
        inner = getattr(opt, "inner_optimizer", opt)  # LossScaleOptimizer: unscale here
        if inner is not opt:
            grads = [g / opt.dynamic_scale.value for g in grads]
        finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads]))
        for v, new in zip(self._layer_ntv, new_layer_ntv):  # BN stats etc.
            v.assign(ops.where(finite, new, v.value))
        if inner is not opt:  # the scale's rule, per micro-batch, without a cond
            grow = ops.equal(opt.step_counter.value, opt.dynamic_growth_steps - 1)
            s, c = opt.dynamic_scale.value, opt.step_counter.value
            opt.dynamic_scale.assign(ops.where(finite, ops.where(grow, s * 2, s), s / 2))
            opt.step_counter.assign(ops.where(finite, ops.where(grow, 0, c + 1), 0))
        if self.accum == 1:  # the default step: finite gate only, no accumulators
            do_apply, at_end, mean = finite, None, grads
        else:
            for acc, g in zip(self._fg_acc, grads):
                acc.assign(acc.value + ops.where(finite, g * n, ops.zeros_like(g)))
            self._fg_samples.assign(self._fg_samples.value + ops.where(finite, n, 0.0))
            self._fg_count.assign(self._fg_count.value + 1.0)
            at_end = ops.greater_equal(self._fg_count.value, float(self.accum))
            do_apply = ops.logical_and(at_end, ops.greater(self._fg_samples.value, 0.0))
            mean = [acc.value / ops.maximum(self._fg_samples.value, 1.0) for acc in self._fg_acc]
        mean = self._clip(mean)
        if self.mode == "where":
            old = [v.value for v in [*self.trainable_variables, *inner.variables]]
            inner.apply(mean, self.trainable_variables)
            for v, o in zip([*self.trainable_variables, *inner.variables], old):
                v.assign(ops.where(do_apply, v.value, o))
        elif self.mode == "cond":
            ops.cond(do_apply, lambda: inner.apply(mean, self.trainable_variables), lambda: None)
        if at_end is not None:
            for acc in self._fg_acc:
                acc.assign(ops.where(at_end, ops.zeros_like(acc.value), acc.value))
            self._fg_samples.assign(ops.where(at_end, 0.0, self._fg_samples.value))
            self._fg_count.assign(ops.where(at_end, 0.0, self._fg_count.value))
        return do_apply, mean

    def _clip(self, grads):
        if self.clip_norm is None:
            return grads
        norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))
        return [g * ops.minimum(1.0, self.clip_norm / ops.maximum(norm, 1e-12)) for g in grads]

    # ---- adapter: JAX-specific ----
    def train_step(self, state, data):
        tv, ntv, ov, mv = state
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(tv, ntv, mv, x, y, sw, training=True, optimizer_variables=ov)
        unscaled_loss, y_pred, new_ntv, mv = aux
        n = ops.cast(ops.shape(jax.tree_util.tree_leaves(x)[0])[0], "float32")
        idx = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        new_layer_ntv = [new_ntv[idx[id(v)]] for v in self._layer_ntv]
        mapping = [
            *zip(self.trainable_variables, tv),
            *zip(self.non_trainable_variables, ntv),
            *zip(self.optimizer.variables, ov),
        ]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            do_apply, mean = self._units(grads, n, new_layer_ntv)
        get = lambda vs: [scope.get_current_value(v) for v in vs]  # noqa: E731
        tv, ntv, ov = (
            get(self.trainable_variables),
            get(self.non_trainable_variables),
            get(self.optimizer.variables),
        )
        if self.mode == "lax":
            inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
            ids = {id(v) for v in inner.variables}
            own = [v for v in self.optimizer.variables if id(v) not in ids]
            tv, ov_inner = jax.lax.cond(
                do_apply,
                lambda t, o, g: inner.stateless_apply(o, g, t),
                lambda t, o, g: (t, o),
                tv,
                get(inner.variables),
                mean,
            )
            ov = get(own) + list(ov_inner)
        # Private in Keras 3.15 (`_update_metrics_variables`): goes behind _compat.py.
        logs, mv = self._update_metrics_variables(mv, unscaled_loss, x, y, y_pred, sw)
        return logs, (tv, ntv, ov, mv)


class NormRecorder(keras.optimizers.Optimizer):
    """Thin wrapper in the manner of LossScaleOptimizer: sees every gradient in the step."""

    def __init__(self, inner, **kwargs):
        super().__init__(learning_rate=0.0, **kwargs)
        self.inner_optimizer = inner

    def build(self, var_list):  # the order of LossScaleOptimizer.build
        self.grad_norm = self.add_variable(shape=(), initializer="zeros", name="grad_norm")
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        if not self.built:  # TF's trainer leaves the build to the first apply
            self.build(trainable_variables)
            self.built = True
        self.grad_norm.assign(ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads)))
        self.inner_optimizer.apply(grads, trainable_variables)


class ReadNorm(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.norms = []

    def on_train_batch_end(self, batch, logs=None):
        self.norms.append(float(self.model.optimizer.grad_norm.numpy()))  # .model syncs JAX state


def mlp(cls=keras.Model, seed=0, width=32, d_in=8, **kw):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d_in,))
    h = inp
    for _ in range(2):
        h = keras.layers.Dense(width, activation="tanh")(h)
    return cls(inp, keras.layers.Dense(3)(h), **kw)


def masked_rnn(cls=keras.Model, seed=0, **kw):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(inp)
    h = keras.layers.GRU(12)(h)
    return cls(inp, keras.layers.Dense(3)(h), **kw)


def max_diff(a, b):
    pairs = zip(a.trainable_variables, b.trainable_variables)
    return max(float(np.max(np.abs(np.asarray(u.value) - np.asarray(v.value)))) for u, v in pairs)


def check(name, build, x, y, keep, mode="where", clip=None, epochs=2, lso=False, iw=True, **fit_kw):
    """Spike on batches of 16 (58 samples: 16,16,16,10) vs keras.Model on batch `keep`."""
    ref = build(keras.Model)
    ref.compile(keras.optimizers.Adam(1e-2, global_clipnorm=clip), "mse")
    ref.fit(x[keep], y[keep], batch_size=len(keep), epochs=epochs, shuffle=False, verbose=0)
    m = build(SpikeModel, clip_norm=clip, mode=mode)
    m.build_step_state(in_weights=iw)
    opt = keras.optimizers.Adam(1e-2)
    opt = keras.optimizers.LossScaleOptimizer(opt) if lso else opt
    m.compile(opt, "mse", **{k: fit_kw.pop(k) for k in list(fit_kw)})
    try:
        m.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    except Exception as e:  # noqa: BLE001
        print(f"{name:44s} FAILS: {type(e).__name__}: {str(e).splitlines()[0][:110]}")
        return
    d = max_diff(ref, m)
    extra = f" scale {float(opt.dynamic_scale.numpy()):g}" if lso else ""
    extra += "" if iw else f" weights {len(m.weights)} vs {len(ref.weights)}"
    print(f"{name:44s} max|w - w_ref| = {d:.2e}  {'OK' if d < 1e-5 else 'MISMATCH'}{extra}")


def correctness():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(58, 8)).astype("float32")
    y = rng.normal(size=(58, 3)).astype("float32")
    every = np.arange(58)
    check("MLP accum 4, uneven last (where)", mlp, x, y, every)
    check("MLP accum 4 + clip_norm 0.05 (where)", mlp, x, y, every, clip=0.05)
    check("MLP accum 4 (lax.cond adapter)", mlp, x, y, every, mode="lax")
    check("MLP accum 4, state outside weights (lax)", mlp, x, y, every, mode="lax", iw=False)
    check("MLP accum 4 (ops.cond + assign inside)", mlp, x, y, every, mode="cond")
    check("MLP accum 4, steps_per_execution=4", mlp, x, y, every, steps_per_execution=4)
    check("MLP accum 4, jit_compile=False", mlp, x, y, every, jit_compile=False)
    xn = x.copy()
    xn[20, 3] = np.nan  # poisons micro-batch 2 (rows 16..31)
    keep = np.r_[0:16, 32:58]
    check("MLP finite gate (batch 2 NaN) + clip", mlp, xn, y, keep, clip=0.05)
    check("MLP gate + clip + LossScaleOptimizer (where)", mlp, xn, y, keep, clip=0.05, lso=True)
    check(
        "MLP gate + clip + LossScaleOptimizer (lax)", mlp, xn, y, keep, "lax", clip=0.05, lso=True
    )
    ti = rng.integers(1, 20, size=(58, 7))
    lengths = rng.integers(2, 8, size=58)
    ti[np.arange(7)[None, :] >= lengths[:, None]] = 0  # right padding, masked
    check("masked GRU accum 4 + clip", masked_rnn, ti.astype("int32"), y, every, clip=0.05)
    # BatchNorm: the gate must keep the moving statistics of a dropped micro-batch.
    m = _bn_spike(accum=4)
    m.build_step_state()
    m.compile(keras.optimizers.Adam(1e-2), "mse")
    m.fit(xn, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    finite = all(np.all(np.isfinite(w)) for w in m.get_weights())
    print(f"{'BatchNorm, NaN micro-batch: all weights/stats finite':44s} {finite}")
    # Q4: optimizer wrapper on a plain model.
    p = mlp()
    p.compile(NormRecorder(keras.optimizers.Adam(1e-2)), "mse")
    cb = ReadNorm()
    p.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    q = mlp()  # reference: the norm of keras' own gradient, batch by batch, eagerly
    q.compile(keras.optimizers.Adam(1e-2), "mse")
    refs = []
    for i in range(0, 58, 16):
        tv, ntv = (
            [v.value for v in q.trainable_variables],
            [v.value for v in q.non_trainable_variables],
        )
        lf = lambda t: ops.mean(
            ops.square(q.stateless_call(t, ntv, x[i : i + 16])[0] - y[i : i + 16])
        )  # noqa: E731
        g = jax.grad(lf)(tv)
        refs.append(float(np.sqrt(sum(np.sum(np.square(a)) for a in g))))
        q.train_on_batch(x[i : i + 16], y[i : i + 16])
    print(
        f"{'NormRecorder on plain fit: callback norms':44s} {np.round(cb.norms, 5)} ref {np.round(refs, 5)}"
    )


def _bn_spike(**kw):
    inp = keras.Input((8,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inp))
    return SpikeModel(inp, keras.layers.Dense(3)(h), **kw)


def timing(rounds=5, steps=32):
    """Step ms, MLP 256 -> 3x1024 -> 10, batch 64, Adam; interleaved rounds of one fit epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=(64 * steps,))
    models = {}
    for name, cls, kw, ga in [
        ("keras", keras.Model, {}, None),
        ("keras_ga4", keras.Model, {}, 4),  # Keras' own gradient_accumulation_steps
        ("spike1_where", SpikeModel, {"accum": 1}, None),
        ("spike1_lax", SpikeModel, {"accum": 1, "mode": "lax"}, None),
        ("spike4_where", SpikeModel, {"accum": 4}, None),
        ("spike4_lax", SpikeModel, {"accum": 4, "mode": "lax"}, None),
        ("normrec", keras.Model, {}, "rec"),
    ]:
        if jax is None and cls is SpikeModel:
            continue
        m = _big(cls, **kw)
        if cls is SpikeModel:
            m.build_step_state()
        opt = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=ga if ga == 4 else None)
        opt = NormRecorder(opt) if ga == "rec" else opt
        jit = True if "xla" in sys.argv else "auto"
        m.compile(
            opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit
        )
        m.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)  # compile
        models[name] = m
    times = {k: [] for k in models}
    for _ in range(rounds):
        for k, m in models.items():
            t = time.perf_counter()
            m.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
            times[k].append((time.perf_counter() - t) / steps * 1e3)
    for k, ts in times.items():
        base = "keras_ga4" if k.startswith("spike4") else "keras"
        r = [a / b for a, b in zip(ts, times[base])]
        print(
            f"{k:13s} ms/step median {np.median(ts):6.2f} best {min(ts):6.2f}   / {base}: "
            f"median ratio {np.median(r):.3f}, best/best {min(ts) / min(times[base]):.3f}"
        )


def _big(cls, **kw):
    keras.utils.set_random_seed(0)
    inp = keras.Input((256,))
    h = inp
    for _ in range(3):
        h = keras.layers.Dense(1024, activation="relu")(h)
    return cls(inp, keras.layers.Dense(10)(h), **kw)


if __name__ == "__main__":
    timing() if "time" in sys.argv[1:] else correctness()
