"""Q4 on TensorFlow: `spike.NormRecorder` on a plain model's fit, read by a callback.

Run with the project's venv: ``KERAS_BACKEND=tensorflow .venv/bin/python
prototypes/jax_step/tf_norm_check.py``. The reference is the plain model's
gradient norm from `tf.GradientTape`, batch by batch.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import spike  # noqa: E402
import tensorflow as tf  # noqa: E402

x = np.random.default_rng(0).normal(size=(58, 8)).astype("float32")
y = x[:, :3] * 2
p = spike.mlp()
p.compile(spike.NormRecorder(keras.optimizers.Adam(1e-2)), "mse")
cb = spike.ReadNorm()
p.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
q = spike.mlp()
q.compile(keras.optimizers.Adam(1e-2), "mse")
refs = []
for i in range(0, 58, 16):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(q(x[i : i + 16]) - y[i : i + 16]))
    grads = tape.gradient(loss, q.trainable_variables)
    refs.append(float(tf.linalg.global_norm(grads)))
    q.train_on_batch(x[i : i + 16], y[i : i + 16])
print("TF NormRecorder", np.round(cb.norms, 5), "ref", np.round(refs, 5))
