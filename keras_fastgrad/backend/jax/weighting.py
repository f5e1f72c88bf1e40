"""How much each micro-batch counts, on JAX: the rule written once,
`keras_fastgrad.step.weighting.forward_with_share` (its maths in
`keras_fastgrad.maths.weighting`), under the name the JAX step's modules
import."""

from keras_fastgrad.step.weighting import forward_with_share  # noqa: F401
