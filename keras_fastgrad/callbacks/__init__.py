"""Keras callbacks that read what the compiled FastGradModel step measured."""

from keras_fastgrad.callbacks.gradient_norm_logger import GradientNormLogger

__all__ = ["GradientNormLogger"]
