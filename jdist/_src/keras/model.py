"""A Keras model seen through its stateless API, as values.

`StatelessModel(model)` offers a Keras 3 model as pure functions of pytrees:
its variables as trees keyed by `variable.path` (`variables.py`), `apply`
through `model.stateless_call`, `assign` to write values back. Random draws
in a step are made over the global batch (`global_draws.py`, docs/keras.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src import jax_compat
from jdist._src.core import placement
from jdist._src.core.replica_context import resolve_batch
from jdist._src.keras import global_draws
from jdist._src.keras import loading
from jdist._src.keras import variables as variables_lib


def _zeros_like(x) -> Any:
  """Concrete zeros of `x`'s shapes and dtypes (x: arrays or their specs)."""
  return jax.tree.map(lambda a: np.zeros(np.shape(a), a.dtype), x)


def _rows(x) -> int:
  leaves = jax.tree.leaves(x)
  return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _layers(model) -> list:
  """The model's layers, nested ones included."""
  out, todo = [], list(getattr(model, "layers", []))
  while todo:
    layer = todo.pop()
    out.append(layer)
    todo.extend(getattr(layer, "layers", []))
  return out


def _report_padding(report) -> None:
  """Calls `report()` on the host when the step's batch holds padding."""
  batch = resolve_batch()
  if batch.mask is None:
    return
  jax.lax.cond(jnp.logical_not(jnp.all(batch.mask)),
               lambda: jax.debug.callback(report), lambda: None)


def _state_keys(variables) -> list[str]:
  """The keys of the non-trainable variables: their paths, but seed states
  numbered in the model's order (Keras numbers them over the program, so a
  model built again would not find its own in a checkpoint)."""
  keys, seeds = [], 0
  for v in variables:
    if v.name == "seed_generator_state":
      keys.append(f"seed_generators/{seeds}")
      seeds += 1
    else:
      keys.append(v.path)
  return keys


class StatelessModel:
  """A Keras model as `(trainable, non_trainable)` trees and a pure apply.

  Args:
    model: a Keras 3 model (JAX backend).

  Raises:
    RuntimeError: keras runs on another backend than JAX.

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, numpy as np
    >>> from jdist._src.keras.model import StatelessModel
    >>> model = keras.Sequential([keras.layers.Dense(2, name="d")], name="s")
    >>> m = StatelessModel(model)
    >>> m.build(np.zeros((1, 3), np.float32))
    >>> trainable, _ = m.variables()
    >>> sorted(trainable["s"]["d"])
    ['bias', 'kernel']
    >>> y, _, losses = m.apply(trainable, {}, np.ones((4, 3), np.float32))
    >>> y.shape
    (4, 2)
  """

  def __init__(self, model):
    self._keras = loading.keras_module("A Keras model")
    self.model = model
    self._paths = None
    self._batch_statistics = None
    self._warned_padding = False

  def build(self, x) -> None:
    """Builds the model for inputs like `x` if it is not built (eagerly,
    also under a JAX trace, so its variables hold values)."""
    if not self.model.built:
      with jax.ensure_compile_time_eval():
        self.model(_zeros_like(x))  # under the program's Keras distribution
    self._paths = None

  @property
  def paths(self) -> tuple[list[str], list[str]]:
    """The paths of the trainable and of the non-trainable variables, in
    the model's order (checked unique)."""
    if self._paths is None:
      if not self.model.built:
        raise ValueError(
            "The Keras model is not built, so it has no variables yet: give "
            "it an Input (keras.Input(shape)), call it on a batch, or let "
            "jdist build it from the first batch of the data.")
      trainable = [v.path for v in self.model.trainable_variables]
      other = _state_keys(self.model.non_trainable_variables)
      variables_lib.check_paths(trainable + other, "model's variables")
      self._paths = (trainable, other)
    return self._paths

  def variables(self) -> tuple[dict, dict]:
    """`(trainable, non_trainable)`: the model's values now, on the host."""
    trainable, other = self.paths
    values = placement.to_host(
        ([v.value for v in self.model.trainable_variables],
         [v.value for v in self.model.non_trainable_variables]))
    return (variables_lib.tree_of(trainable, values[0]),
            variables_lib.tree_of(other, values[1]))

  def apply(self, trainable, non_trainable, x, *, training: bool = False):
    """`(y, non_trainable, losses)`: `model.stateless_call` on trees.

    Args:
      trainable, non_trainable: trees as `variables()` gives them.
      x: the inputs.
      training: Keras's `training` argument.

    Returns:
      The outputs, the new non-trainable values, and the model's losses
      (a list of scalars, as `model.losses`).
    """
    trainable_paths, other_paths = self.paths
    tv = variables_lib.at_paths(trainable, trainable_paths, "trainable values")
    ntv = variables_lib.at_paths(non_trainable, other_paths,
                                 "non-trainable values")

    def call(tv, ntv, x):
      return self.model.stateless_call(tv, ntv, x, training=training,
                                       return_losses=True)

    if training and self.batch_statistics:
      _report_padding(self._warn_padding)
    with loading.no_distribution(), jax_compat.varying_loop_carries():
      if training:
        y, ntv, losses = global_draws.call(call, tv, ntv, x, rows=_rows(x))
      else:
        y, ntv, losses = call(tv, ntv, x)
    return y, variables_lib.tree_of(other_paths, ntv), list(losses)

  @property
  def batch_statistics(self) -> bool:
    """Whether the model has a `BatchNormalization` layer."""
    if self._batch_statistics is None:
      norm = self._keras.layers.BatchNormalization
      self._batch_statistics = any(
          isinstance(layer, norm) for layer in _layers(self.model))
    return self._batch_statistics

  def _warn_padding(self) -> None:
    if self._warned_padding:
      return
    self._warned_padding = True
    warnings.warn(
        "A training batch of the Keras model was padded (the data's last "
        "batch is shorter than the batch size, or does not split evenly over "
        "the replicas): its BatchNormalization layers compute their batch "
        "statistics over the padding rows too, where Keras's fit uses the "
        "short batch's examples alone, so training differs from Keras's. "
        "Choose a batch size that divides the number of examples (and each "
        "batch the replicas), or drop the short batch (e.g. x[:n - n % "
        "batch_size]).", UserWarning, stacklevel=2)

  @property
  def has_losses(self) -> bool:
    """Whether the model adds losses of its own (regularizers, add_loss)."""
    return bool(self.model.losses)

  def assign(self, trainable, non_trainable) -> None:
    """Writes values (trees as `variables()` gives them) into the model."""
    trainable_paths, other_paths = self.paths
    pairs = zip(self.model.trainable_variables + self.model.
                non_trainable_variables,
                variables_lib.at_paths(trainable, trainable_paths,
                                       "trainable values") +
                variables_lib.at_paths(non_trainable, other_paths,
                                       "non-trainable values"))
    for variable, value in pairs:
      variable.assign(placement.to_host(value))
