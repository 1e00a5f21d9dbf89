"""`trainer.optimizer`: the optax transformation as Keras code sees it, its
`learning_rate` read and assigned (`.numpy()`, `.assign(...)`, `= value`)
in the optimizer state (`optax.inject_hyperparams`).
"""

from __future__ import annotations

import numpy as np
import optax

from jdist._src.core import placement


def learning_rate(opt_state) -> float:
  """The learning rate in an optimizer state (ValueError if none)."""
  return float(np.asarray(placement.to_host(_learning_rate_leaf(opt_state))))


def with_learning_rate(opt_state, value: float):
  """`opt_state` with learning rate `value`, dtype kept (ValueError if none)."""
  old = _learning_rate_leaf(opt_state)
  return optax.tree_utils.tree_set(
      opt_state, learning_rate=np.asarray(value, dtype=old.dtype))


def _learning_rate_leaf(opt_state):
  lr = optax.tree_utils.tree_get(opt_state, "learning_rate", default=None)
  if lr is None:
    raise ValueError(
        "The optimizer's learning rate is not part of its state, so it "
        "cannot be changed during training. Build the optimizer with "
        "optax.inject_hyperparams, e.g. "
        "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).")
  return lr


class Hyperparameter:
  """A hyperparameter in the optimizer state, read like a Keras variable.

  Example:
    >>> from jdist._src.training.optimizer import Hyperparameter
    >>> lr = Hyperparameter(lambda: 0.01, print)
    >>> float(lr), round(float(lr.numpy()), 6)
    (0.01, 0.01)
  """

  def __init__(self, read, write):
    self._read = read
    self._write = write

  def numpy(self) -> np.float32:
    """The current value (a numpy scalar), as `tf.Variable.numpy()`."""
    return np.float32(self._read())

  def assign(self, value) -> None:
    """Sets the value for the next steps, as `tf.Variable.assign`."""
    self._write(float(value))

  def __float__(self) -> float:
    return float(self._read())

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self.numpy(), dtype)

  def __repr__(self) -> str:
    return f"{float(self):g}"

  def __format__(self, spec: str) -> str:
    return format(float(self), spec)


class OptimizerView:
  """`trainer.optimizer`: the learning rate, the step count, the optax calls."""

  def __init__(self, trainer, transformation):
    self._trainer = trainer
    self.transformation = transformation

  @property
  def learning_rate(self) -> Hyperparameter:
    """The current learning rate (needs `optax.inject_hyperparams`)."""
    trainer = self._trainer
    return Hyperparameter(lambda: trainer.learning_rate,
                          lambda v: setattr(trainer, "learning_rate", v))

  @learning_rate.setter
  def learning_rate(self, value) -> None:
    self._trainer.learning_rate = float(value)

  lr = learning_rate

  @property
  def iterations(self) -> int:
    """Optimizer steps applied so far (Keras' `optimizer.iterations`)."""
    return self._trainer.global_step

  def init(self, params):
    """`transformation.init`."""
    return self.transformation.init(params)

  def update(self, updates, state, params=None):
    """`transformation.update`."""
    return self.transformation.update(updates, state, params)
