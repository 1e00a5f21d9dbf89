"""Keras loss and metric objects as `jdist.losses` and `jdist.metrics` values.

A Keras metric's variables are the running sums: each replica updates its
copy, and reading adds the copies (exact only for sums from zero: checked).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.core import context
from jdist._src.core.replica_context import resolve_batch
from jdist._src.core.values import SyncOnRead
from jdist._src.keras import loading
from jdist._src.ops import loss_objects
from jdist._src.ops import metrics as metrics_lib

# What the trainer's first-batch checks expect of a Keras loss's inputs,
# by its class name (any other: no class checks).
_KINDS = {
    "SparseCategoricalCrossentropy": "sparse",
    "CategoricalCrossentropy": "categorical",
    "CategoricalFocalCrossentropy": "categorical",
    "BinaryCrossentropy": "binary",
    "BinaryFocalCrossentropy": "binary",
}
# Keras's reductions that are the trainer's: the sum over the examples
# divided by their number.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class KerasLoss(loss_objects.Loss):
  """A `keras.losses.Loss` object as a `jdist.losses.Loss`.

  Raises:
    ValueError: `loss`'s reduction is not Keras's default
      ("sum_over_batch_size" or "mean"), which the trainer would not honour.

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, jax.numpy as jnp
    >>> from jdist._src.keras.objectives import KerasLoss
    >>> loss = KerasLoss(keras.losses.MeanSquaredError())
    >>> loss.call(jnp.array([[1.0], [2.0]]), jnp.array([[2.0], [2.0]]))
    Array([1., 0.], dtype=float32)
  """

  def __init__(self, loss):
    if loss.reduction not in _MEAN_REDUCTIONS:
      raise ValueError(
          f"The Keras loss {loss.name!r} has reduction={loss.reduction!r}; "
          "jdist's trainer reduces losses as Keras's default does (the "
          "weighted sum over the number of examples of the global batch). "
          "Build it with reduction=\"sum_over_batch_size\" (the default).")
    super().__init__("none", loss.name)
    self.keras_loss = loss
    self.kind = _KINDS.get(type(loss).__name__, "regression")
    if self.kind != "regression":
      self.from_logits = bool(loss.get_config().get("from_logits", False))

  def call(self, y_true, y_pred) -> jax.Array:
    dtype = self.keras_loss.dtype
    y_true = jax.tree.map(lambda a: jnp.asarray(a, dtype), y_true)
    y_pred = jax.tree.map(lambda a: jnp.asarray(a, dtype), y_pred)
    return self.keras_loss.call(y_true, y_pred)

  def get_config(self) -> dict:
    return self.keras_loss.get_config()


def resolve_loss(loss) -> loss_objects.Loss:
  """A Keras loss object, or a name Keras knows, as a `jdist.losses.Loss`
  (ValueError for a name Keras does not know either)."""
  if not isinstance(loss, str):
    return KerasLoss(loss)
  keras = loading.keras_module(f"The loss {loss!r}")
  try:
    found = keras.losses.get(loss)
  except ValueError:
    found = None
  if found is None:
    raise ValueError(
        f"Unknown loss {loss!r}: neither jdist's ({sorted(loss_objects.BY_NAME)}) "
        "nor a Keras loss's name. Pass a jdist.losses or keras.losses "
        "object, or a function loss(y_true, y_pred) returning one value per "
        "example.")
  if loading.is_loss(found):
    return KerasLoss(found)
  return loss_objects.LossFunctionWrapper(found, name=loss)


def _zero_initialised(metric) -> bool:
  return all(not np.any(np.asarray(v.value)) for v in metric.variables)


class KerasMetric(metrics_lib.Metric):
  """A `keras.metrics.Metric` object as a `jdist.metrics.Metric`: `update`
  runs its `stateless_update_state` on this replica's copy of its variables
  (padding weighted 0), and `result()` adds the copies first."""

  name: str = "keras_metric"
  keras_metric: Any = None

  @classmethod
  def of(cls, metric, name: str | None = None) -> "KerasMetric":
    """The jdist form of a Keras metric, its sums at zero (ValueError if its
    variables do not start at zero: not sums that replicas can add)."""
    if not _zero_initialised(metric):
      raise ValueError(
          f"The Keras metric {metric.name!r} starts with non-zero variables, "
          "so its state is not a sum that the replicas' copies add up to: "
          "jdist cannot keep it exactly over replicas. Use a metric whose "
          "variables are counts or sums (Keras's built-in metrics are).")
    totals = SyncOnRead({v.name: jnp.zeros(v.shape, v.dtype)
                         for v in metric.variables}, "sum")
    return cls(name or metric.name, metric, totals=totals)

  def _values(self, tree) -> list:
    return [tree[v.name] for v in self.keras_metric.variables]

  def update(self, y_true, y_pred, sample_weight=None, *, mask=None
             ) -> "KerasMetric":
    """Adds a batch's examples; returns the updated metric."""
    weights = sample_weight
    batch = resolve_batch(mask=mask)
    if batch.mask is not None:
      valid = batch.mask.astype(jnp.float32)
      if weights is None:
        weights = valid
      else:
        weights = jnp.asarray(weights, jnp.float32)
        weights = weights * valid.reshape(valid.shape + (1,) *
                                          (weights.ndim - 1))
    new = self.keras_metric.stateless_update_state(
        self._values(self.totals.value), y_true, y_pred,
        sample_weight=weights)
    per_replica = self.totals.per_replica or (
        context.current_replica_context() is not None)
    names = [v.name for v in self.keras_metric.variables]
    return dataclasses.replace(self, totals=SyncOnRead(
        dict(zip(names, new)), "sum", per_replica))

  def value_of(self, sums: dict):
    """The Keras metric's result from its variables summed over replicas."""
    values = [jnp.asarray(sums[v.name], v.dtype)
              for v in self.keras_metric.variables]
    return self.keras_metric.stateless_result(values)

  def with_sums(self, sums: dict) -> "KerasMetric":
    """The same metric holding `sums` (its variables over every replica)."""
    return dataclasses.replace(self, totals=SyncOnRead(
        {v.name: jnp.asarray(sums[v.name], v.dtype)
         for v in self.keras_metric.variables}, "sum"))

  def __repr__(self) -> str:
    return f"KerasMetric(name={self.name!r}, {self.keras_metric!r})"


def metric_for_name(name: str):
  """The Keras metric object Keras makes for `name`, if keras is loaded and
  knows it; None otherwise (jdist's own names are looked up first)."""
  if loading.backend_problem() is not None or not loading.is_loaded():
    return None
  keras = loading.keras_module(f"The metric {name!r}")
  try:
    metric = keras.metrics.get(name)
  except ValueError:
    return None
  return metric if loading.is_metric(metric) else None
