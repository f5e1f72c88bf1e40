"""The TensorFlow shell of the step: how the step runs on Keras' TensorFlow
backend (a `tf.GradientTape`, state in variables, `tf.cond` and
`tf.while_loop`, `tf.distribute` replicas, `tf.IndexedSlices`). The rules it
applies are the backend-neutral core's (`keras_fastgrad.step`,
`keras_fastgrad.maths`).
"""
