"""Backend-neutral maths of the step's units (keras.ops, explicit inputs)."""
