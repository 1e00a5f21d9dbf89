"""`jdist.keras_functions`: a Keras model and optimizer as a pytree of
variables and pure functions for a custom loop's step (a JAX step cannot
update Keras variables in place; `assign` writes them back).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jdist._src.keras import loading
from jdist._src.keras.model import StatelessModel
from jdist._src.keras.optimizer import KerasOptimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KerasVariables:
  """A Keras model's variables as a pytree, for a custom loop's state.

  Attributes:
    trainable: the trainable variables, nested dicts by `variable.path`.
    non_trainable: the others (moving statistics, seed states), the same way.
    optimizer: the optimizer's variables (None without an optimizer).
  """

  trainable: Any
  non_trainable: Any
  optimizer: Any = None

  def replace(self, **changes) -> "KerasVariables":
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)


class KerasFunctions:
  """The pure functions of a Keras model and optimizer (`keras_functions`)."""

  def __init__(self, model: StatelessModel, optimizer: KerasOptimizer | None):
    self._model = model
    self._optimizer = optimizer
    self.model = model.model

  def call(self, trainable, non_trainable, x, *, training: bool = False):
    """`(y, non_trainable, losses)`: Keras's `model.stateless_call` on trees.

    Random draws are made over the global batch, as on one replica.
    """
    return self._model.apply(trainable, non_trainable, x, training=training)

  def apply_gradients(self, variables: KerasVariables, grads
                      ) -> KerasVariables:
    """The optimizer's step (`optimizer.stateless_apply`) on `variables`.

    Raises:
      ValueError: `keras_functions` was given no optimizer.
    """
    if self._optimizer is None:
      raise ValueError(
          "keras_functions(model) was given no optimizer: pass it, "
          "keras_functions(model, optimizer), to apply gradients.")
    trainable, state = self._optimizer.apply(grads, variables.optimizer,
                                             variables.trainable)
    return variables.replace(trainable=trainable, optimizer=state)

  def assign(self, variables: KerasVariables) -> None:
    """Writes the trainable and non-trainable values into the Keras model
    (for `model.save`, `model.predict`, `model.evaluate`)."""
    self._model.assign(variables.trainable, variables.non_trainable)


def keras_functions(model, optimizer=None
                    ) -> tuple[KerasVariables, KerasFunctions]:
  """A Keras model (and optimizer) as `(variables, functions)` for a loop.

  Args:
    model: a built Keras 3 model (JAX backend).
    optimizer: a Keras optimizer object or name ("adam"), or None.

  Returns:
    `(KerasVariables, KerasFunctions)`: the state and what the step calls.

  Raises:
    ValueError: the model is not built (`model.build(input_shape)`).

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import jax, keras, jdist, numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> variables, fns = jdist.keras_functions(model, "sgd")
    >>> strategy = jdist.MirroredStrategy()
    >>> @strategy.function
    ... def train_step(variables, x, y):
    ...   def loss_fn(trainable):
    ...     pred, _, _ = fns.call(trainable, variables.non_trainable, x,
    ...                           training=True)
    ...     return jdist.compute_average_loss(((pred - y) ** 2).mean(-1))
    ...   loss, grads = jax.value_and_grad(loss_fn)(variables.trainable)
    ...   return fns.apply_gradients(variables, grads), loss
    >>> n = strategy.num_replicas_in_sync
    >>> x, y = np.ones((4 * n, 3), np.float32), np.zeros((4 * n, 2), np.float32)
    >>> (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    >>> variables, loss = train_step(strategy.replicate(variables), *batch)
    >>> fns.assign(variables)   # the Keras model now holds the new values
  """
  stateless = StatelessModel(model)
  if not model.built:
    raise ValueError(
        "keras_functions needs a built Keras model, whose variables exist: "
        "give it an Input (keras.Input(shape) first in a Sequential), or "
        "call model.build(input_shape) (or the model on a batch) first.")
  trainable, non_trainable = stateless.variables()
  tx = None
  opt_state = None
  if optimizer is not None:
    loading.keras_module("keras_functions")
    tx = KerasOptimizer.of(optimizer)
    opt_state = tx.init(trainable)
  return (KerasVariables(trainable, non_trainable, opt_state),
          KerasFunctions(stateless, tx))
