"""What the Trainer takes as an optimizer, as the optax transformation its
steps apply.

One entry point, `resolve`, so that every kind of optimizer a user passes
(an optax `GradientTransformation` today) reaches the training program the
same way: the program, loss scaling and `ShardedOptimizer` only ever see
optax.
"""

from __future__ import annotations

import optax


def resolve(optimizer) -> optax.GradientTransformation:
  """The optax transformation for `optimizer`.

  Raises:
    TypeError: `optimizer` is not an optimizer jdist knows.

  Example:
    >>> import optax
    >>> from jdist._src.training import optimizers
    >>> tx = optimizers.resolve(optax.sgd(0.1))
    >>> isinstance(tx, optax.GradientTransformation)
    True
  """
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  raise TypeError(
      f"optimizer must be an optax GradientTransformation (for example "
      f"optax.adam(1e-3)), got {type(optimizer).__name__}.")
