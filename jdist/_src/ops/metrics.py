"""Keras' metrics as values: updated inside a step, read outside it, exact.

A metric's running sums are a `SyncOnRead` SUM value, as TensorFlow keeps
metric variables: each replica adds its own examples (padding left out) and
reading adds the replicas, so `result()` is exact on any number of devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.core.replica_context import resolve_batch
from jdist._src.core.values import SyncOnRead
from jdist._src.ops import loss_objects

_SUMS = ("total", "count")


def _zeros() -> SyncOnRead:
  return SyncOnRead({k: jnp.zeros((), jnp.float32) for k in _SUMS}, "sum")


def _as_float(x) -> jax.Array:
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def _row_weights(values, sample_weight, mask) -> tuple[jax.Array, jax.Array]:
  """`values` and their weights (sample weight times validity), same shape."""
  values = _as_float(values)
  weights = jnp.ones(values.shape, values.dtype)
  if sample_weight is not None:
    sw = _as_float(sample_weight)
    while sw.ndim > values.ndim and sw.shape[-1] == 1:
      sw = sw[..., 0]  # (b, 1) weights for (b,) values
    sw = sw.reshape(sw.shape + (1,) * (values.ndim - sw.ndim))
    weights = weights * sw.astype(values.dtype)
  batch = resolve_batch(mask=mask)
  if batch.mask is not None:
    rows = batch.mask.shape[0]
    if values.ndim == 0:
      # A per-replica scalar counts once where the replica has any example.
      weights = weights * jnp.any(batch.mask).astype(values.dtype)
    elif values.shape[0] != rows:
      raise ValueError(
          f"The metric got values with {values.shape[0]} rows, but this "
          f"replica's batch has {rows} examples, so it cannot tell which are "
          "padding. Update it with one value per example, or pass mask= "
          "(one boolean per row of the values).")
    else:
      m = batch.mask.reshape((rows,) + (1,) * (values.ndim - 1))
      weights = jnp.where(m, weights, 0)
  return values, weights


def _one_per_row(values) -> jax.Array:
  """Per-example values: the mean over every axis after the first."""
  values = _as_float(values)
  if values.ndim > 1:
    values = jnp.mean(values.reshape(values.shape[0], -1), axis=1)
  return values


def _refuse(name: str, fix: str):
  """A Keras in-place method, which would silently do nothing here: raises."""
  def method(self, *args, **kwargs):
    raise TypeError(
        f"jdist metrics are values, not variables: {type(self).__name__}."
        f"{name}() would change nothing. Write {fix} (inside a step, return "
        "the new metric from it).")
  method.__name__ = name
  return method


def _frozen_pytree(cls: type) -> type:
  """`cls` as a frozen dataclass and a pytree whose one leaf is `totals`."""
  # A class that writes its own __init__ (MeanMetricWrapper) keeps it.
  dataclasses.dataclass(frozen=True, repr=False,
                        init="__init__" not in vars(cls))(cls)
  config = [f.name for f in dataclasses.fields(cls) if f.name != "totals"]
  jax.tree_util.register_dataclass(cls, data_fields=["totals"],
                                   meta_fields=config)
  return cls


@_frozen_pytree
class Metric:
  """Base class: a running `total` and `count`, summed over replicas on read.

  A frozen pytree, carried through steps and checkpoints as state.

  Attributes:
    name: the metric's name (the key in logs).
    totals: the running sums (`SyncOnRead` SUM), the one pytree leaf.
  """

  name: str
  totals: SyncOnRead = dataclasses.field(default_factory=_zeros, kw_only=True)

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _frozen_pytree(cls)

  def _add(self, values, weights) -> "Metric":
    """Adds weighted `values` (already masked) to the running sums."""
    batch = {"total": jnp.sum(values * weights, dtype=jnp.float32),
             "count": jnp.sum(weights, dtype=jnp.float32)}
    old = self.totals.value
    # Inside a step every replica keeps its own sums (read adds them up).
    per_replica = self.totals.per_replica or (
        context.current_replica_context() is not None)
    return dataclasses.replace(self, totals=SyncOnRead(
        {k: old[k] + batch[k] for k in _SUMS}, "sum", per_replica))

  def sums(self) -> dict:
    """`{"total", "count"}` summed over every replica (and process)."""
    totals = self.totals
    if not totals.per_replica:
      return totals.value
    ctx = context.current_replica_context()
    if ctx is not None:  # inside a step: add every replica's sums
      value = jax.tree.map(lambda v: in_step.to_varying(v, ctx.axis_name),
                           totals.value)
      return ctx.all_reduce("sum", value)
    return totals.read()

  def result(self) -> jax.Array:
    """`total / count` over every example seen (0.0 if none, as in Keras)."""
    return self.value_of(self.sums())

  def value_of(self, sums: dict):
    """The result from sums over every replica (0.0 for a count of 0)."""
    total, count = sums["total"], sums["count"]
    if isinstance(count, jax.core.Tracer):  # in a step (or the user's jit)
      empty = count == 0
      return jnp.where(empty, jnp.zeros_like(total),
                       total / jnp.where(empty, jnp.ones_like(count), count))
    return total / count if count else jnp.zeros_like(total)

  def reset(self) -> "Metric":
    """The same metric with its sums at zero (placed as before)."""
    return dataclasses.replace(
        self, totals=jax.tree.map(jnp.zeros_like, self.totals))

  def with_sums(self, sums: dict) -> "Metric":
    """The same metric holding `sums` (as `sums()` returns them).

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> m = jdist.metrics.Mean().update(jnp.array([1.0, 2.0]))
      >>> saved = {k: float(v) for k, v in m.sums().items()}
      >>> restored = jdist.metrics.Mean().with_sums(saved)
      >>> float(restored.update(jnp.array([6.0])).result())
      3.0
    """
    if not (hasattr(sums, "keys") and set(_SUMS) <= set(sums.keys())):
      raise ValueError(
          f"{type(self).__name__}.with_sums needs a mapping with 'total' and "
          f"'count' (what metric.sums() returns), got {sums!r}.")
    return dataclasses.replace(self, totals=SyncOnRead(
        {k: jnp.asarray(sums[k], jnp.float32) for k in _SUMS}, "sum"))

  def __repr__(self) -> str:
    count = self.totals.value["count"]
    if self.totals.per_replica or isinstance(count, jax.core.Tracer):
      state = "per replica"
    else:
      state = f"count={float(count):g}"
    return f"{type(self).__name__}(name={self.name!r}, {state})"

  # Keras' in-place methods would silently do nothing here: say so.
  update_state = _refuse("update_state", "m = m.update(...)")
  reset_state = _refuse("reset_state", "m = m.reset()")
  reset_states = _refuse("reset_states", "m = m.reset()")


class Mean(Metric):
  """The (weighted) mean of the values it is given, as `keras.metrics.Mean`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.Mean().update(jnp.array([1.0, 2.0, 6.0]))
    >>> float(m.result())
    3.0
    >>> float(m.reset().result())  # nothing seen: 0.0, as in Keras
    0.0
  """

  name: str = "mean"

  def update(self, values, sample_weight=None, *, mask=None) -> "Mean":
    """Adds `values` (weighted); returns the updated metric."""
    return self._add(*_row_weights(values, sample_weight, mask))


class Sum(Mean):
  """The (weighted) sum of the values it is given, as `keras.metrics.Sum`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> float(jdist.metrics.Sum().update(jnp.array([1.0, 2.0])).result())
    3.0
  """

  name: str = "sum"

  def value_of(self, sums: dict):
    """The sum over every replica (and process)."""
    return sums["total"]


class _PerExampleMean(Mean):
  """The mean of a per-example function `_fn(y_true, y_pred)`."""

  def _fn(self, y_true, y_pred) -> jax.Array:
    raise NotImplementedError

  def update(self, y_true, y_pred, sample_weight=None, *, mask=None):
    """Adds a batch's examples (one row each, weighted by `sample_weight`;
    `mask`: the real rows, default the step's); returns the new metric."""
    values = _one_per_row(self._fn(jnp.asarray(y_true), jnp.asarray(y_pred)))
    return super().update(values, sample_weight, mask=mask)


def _labels(y_true, y_pred) -> jax.Array:
  """Integer labels shaped like `y_pred` without its class axis."""
  if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
    y_true = y_true[..., 0]
  return y_true


def _hits(a, b) -> jax.Array:
  return (a == b).astype(jnp.float32)


class Accuracy(_PerExampleMean):
  """How often `y_pred` equals `y_true` exactly, as `keras.metrics.Accuracy`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.Accuracy().update(jnp.array([1, 2, 3]), jnp.array([1, 2, 0]))
    >>> round(float(m.result()), 4)
    0.6667
  """

  name: str = "accuracy"

  def _fn(self, y_true, y_pred):
    return _hits(y_true.astype(y_pred.dtype), y_pred)


class SparseCategoricalAccuracy(_PerExampleMean):
  """Integer labels against class scores (argmax), as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> logits = jnp.array([[0.1, 2.0], [3.0, 0.0], [0.0, 1.0]])
    >>> m = jdist.metrics.SparseCategoricalAccuracy()
    >>> round(float(m.update(jnp.array([1, 1, 1]), logits).result()), 4)
    0.6667
  """

  name: str = "sparse_categorical_accuracy"

  def _fn(self, y_true, y_pred):
    labels = _labels(y_true, y_pred).astype(jnp.int32)
    return _hits(jnp.argmax(y_pred, -1), labels)


class CategoricalAccuracy(_PerExampleMean):
  """One-hot targets against class scores (argmax of both), as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.CategoricalAccuracy().update(
    ...     jnp.array([[0, 1], [1, 0]]), jnp.array([[0.2, 0.8], [0.3, 0.7]]))
    >>> float(m.result())
    0.5
  """

  name: str = "categorical_accuracy"

  def _fn(self, y_true, y_pred):
    return _hits(jnp.argmax(y_pred, -1), jnp.argmax(y_true, -1))


class BinaryAccuracy(_PerExampleMean):
  """`y_pred > threshold` against 0/1 targets, as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.BinaryAccuracy().update(
    ...     jnp.array([1, 0, 1, 0]), jnp.array([0.9, 0.2, 0.4, 0.6]))
    >>> float(m.result())
    0.5
  """

  name: str = "binary_accuracy"
  threshold: float = 0.5

  def __post_init__(self):
    # A static field must hash: a NumPy or JAX scalar becomes a float.
    object.__setattr__(self, "threshold", float(self.threshold))

  def _fn(self, y_true, y_pred):
    if y_true.size == y_pred.size:
      y_true = jnp.reshape(y_true, y_pred.shape)
    return _hits(y_true.astype(jnp.float32),
                 (y_pred > self.threshold).astype(jnp.float32))


class MeanSquaredError(_PerExampleMean):
  """Mean of `(y_true - y_pred) ** 2`, as `keras.metrics.MeanSquaredError`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.MeanSquaredError().update(jnp.array([1.0, 2.0]),
    ...                                             jnp.array([2.0, 4.0]))
    >>> float(m.result())
    2.5
  """

  name: str = "mean_squared_error"

  def _fn(self, y_true, y_pred):
    return loss_objects.squared_error(y_true, y_pred)


class MeanAbsoluteError(_PerExampleMean):
  """Mean of `|y_true - y_pred|`, as `keras.metrics.MeanAbsoluteError`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> m = jdist.metrics.MeanAbsoluteError().update(jnp.array([1.0, 2.0]),
    ...                                              jnp.array([2.0, 4.0]))
    >>> float(m.result())
    1.5
  """

  name: str = "mean_absolute_error"

  def _fn(self, y_true, y_pred):
    return loss_objects.absolute_error(y_true, y_pred)


class MeanMetricWrapper(_PerExampleMean):
  """The mean of `fn(y_true, y_pred)`, a per-example function, as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> close = lambda y_true, y_pred: jnp.abs(y_true - y_pred) < 0.5
    >>> m = jdist.metrics.MeanMetricWrapper(close, name="close")
    >>> float(m.update(jnp.array([1.0, 2.0]), jnp.array([1.2, 3.0])).result())
    0.5
  """

  fn: Callable

  # Keras' argument order (fn first) and a name taken from fn: written out.
  def __init__(self, fn: Callable, name: str | None = None, *,
               totals: Any = None):
    if not callable(fn):
      raise TypeError(f"MeanMetricWrapper needs a function, got {fn!r}.")
    object.__setattr__(self, "fn", fn)
    object.__setattr__(self, "name",
                       name or getattr(fn, "__name__", "metric"))
    object.__setattr__(self, "totals", _zeros() if totals is None else totals)

  def _fn(self, y_true, y_pred):
    return self.fn(y_true, y_pred)
