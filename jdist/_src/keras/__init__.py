"""Keras 3 models, optimizers, losses and metrics (JAX backend) as jdist values.

Nothing imports keras: each entry point looks for it in `sys.modules`
(`loading.py`), so `import jdist` stays free of it.
"""
