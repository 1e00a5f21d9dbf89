"""Keras-style training on any jdist strategy: Trainer, callbacks, checkpoints."""
