"""What the Trainer takes as an optimizer, as the optax transformation its
steps apply.

One entry point, `resolve`, so that every kind of optimizer a user passes
(an optax `GradientTransformation`, a Keras optimizer object, or a Keras
optimizer's name such as "adam") reaches the training program the same way:
the program, loss scaling and `ShardedOptimizer` only ever see optax.
"""

from __future__ import annotations

import optax

from jdist._src.keras import loading as keras_loading
from jdist._src.keras import optimizer as keras_optimizer


def resolve(optimizer) -> optax.GradientTransformation:
  """The optax transformation for `optimizer`.

  Raises:
    TypeError: `optimizer` is not an optimizer jdist knows.
    ImportError: a Keras optimizer's name was given without keras installed.

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
