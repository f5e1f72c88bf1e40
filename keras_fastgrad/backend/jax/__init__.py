"""The JAX shell of the step: how the step runs on Keras' JAX backend.

A stateless `train_step(state, data)` in the manner of Keras' JAX trainer
(`step.py`): gradients from `jax.value_and_grad`, state threaded through
Keras' state tuple, conditionals as `lax.cond`. The rules it applies are the
backend-neutral core's (`keras_fastgrad.step`, `keras_fastgrad.maths`).
"""
