"""`jdist.keras_functions`: a Keras model and its optimizer as the values and
pure functions a custom training loop's `strategy.function` step uses.

TensorFlow's "Custom training with tf.distribute.Strategy" keeps a Keras
model and optimizer whose variables the step updates in place. Under JAX a
step is a pure function, so the model comes apart into its variables, a
pytree that goes in and out of the step (`KerasVariables`: trainable,
non-trainable and the optimizer's, keyed by `variable.path`), and the
functions that compute with them (`KerasFunctions`): the model's
`stateless_call` and the optimizer's `stateless_apply`. After training,
`assign` writes the values back into the model.
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
    trainable: the trainable variables, nested dicts by `variable.path`
      (what gradients are taken with respect to).
    non_trainable: the others (BatchNormalization's moving statistics,
      random layers' seed states), the same way.
    optimizer: the optimizer's variables (its moments under the slot's name
      and the parameter's path, `iteration`, `learning_rate`); None without
      an optimizer.
  """

  trainable: Any
  non_trainable: Any
  optimizer: Any = None

  def replace(self, **changes) -> "KerasVariables":
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)


class KerasFunctions:
  """The pure functions of a Keras model and optimizer (see `keras_functions`).

  Attributes:
    model: the Keras model.
  """

  def __init__(self, model: StatelessModel, optimizer: KerasOptimizer | None):
    self._model = model
    self._optimizer = optimizer
    self.model = model.model

  def call(self, trainable, non_trainable, x, *, training: bool = False):
    """`(y, non_trainable, losses)`: Keras's `model.stateless_call(trainable,
    non_trainable, x, training=training, return_losses=True)` on trees.

    Inside a step on several replicas the model's random draws (Dropout) are
    made over the global batch, each replica keeping its rows, so training
    is the same on any number of replicas. `losses` is the list of the
    model's own losses (regularizers, `add_loss`), as `model.losses`.
    """
    return self._model.apply(trainable, non_trainable, x, training=training)

  def apply_gradients(self, variables: KerasVariables, grads
                      ) -> KerasVariables:
    """The optimizer's step (`optimizer.stateless_apply`): `variables` with
    new trainable and optimizer values.

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
    """Writes the model's values (trainable and non-trainable) into the
    Keras model, as its variables would be after Keras's own training, so
    that `model.save`, `model.predict` and `model.evaluate` see them."""
    self._model.assign(variables.trainable, variables.non_trainable)


def keras_functions(model, optimizer=None
                    ) -> tuple[KerasVariables, KerasFunctions]:
  """A Keras model (and optimizer) as `(variables, functions)` for a custom
  loop.

  Args:
    model: a built Keras 3 model (JAX backend): give it an `Input`, or call
      `model.build(input_shape)` first.
    optimizer: a Keras optimizer object or name ("adam"), or None.

  Returns:
    `(variables, functions)`: the model's current values (and the
    optimizer's fresh ones) as a `KerasVariables` pytree, to place with
    `strategy.replicate` and carry through the steps; and a
    `KerasFunctions` whose `call` and `apply_gradients` the step uses.

  Raises:
    ValueError: the model is not built.

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
