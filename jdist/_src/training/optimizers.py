"""`resolve`: whatever the Trainer takes as an optimizer (optax, a Keras
optimizer or its name) as the optax transformation its steps apply."""

from __future__ import annotations

import optax

from jdist._src.keras import loading as keras_loading
from jdist._src.keras import optimizer as keras_optimizer


def resolve(optimizer) -> optax.GradientTransformation:
  """The optax transformation for `optimizer`; TypeError for one jdist does
  not know, ImportError for a Keras name without keras.

  Example:
    >>> import optax
    >>> from jdist._src.training import optimizers
    >>> tx = optimizers.resolve(optax.sgd(0.1))
    >>> isinstance(tx, optax.GradientTransformation)
    True
  """
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  if isinstance(optimizer, str) or keras_loading.is_optimizer(optimizer):
    return keras_optimizer.resolve(optimizer)
  raise TypeError(
      f"optimizer must be an optax GradientTransformation (for example "
      f"optax.adam(1e-3)), a Keras optimizer or its name (\"adam\"), got "
      f"{type(optimizer).__name__}.")
