"""Keras 3 models, optimizers, losses and metrics (JAX backend) as jdist values.

Nothing here imports keras at import time: a Keras object can exist only in
a program that imported keras, so each entry point looks for it in
`sys.modules` first (`loading.py`), and `import jdist` stays free of it.
"""
