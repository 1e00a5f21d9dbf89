"""Distributed values: `PerReplica`, `SyncOnRead` and `Sharded`, all pytrees.

What a step does with each is the value's kind, written once in `kinds.py`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._src.core import context
from jdist._src.core.reduce_op import VariableAggregation
from jdist._src.core.validity import Validity


class DistributedValue:
  """A value spread over a strategy's replicas (as `tf.distribute.DistributedValues`).

  Pytree functions that must keep such values whole pass
  `is_leaf=is_distributed`.
  """

  __slots__ = ()


class PerReplica(DistributedValue):
  """One value per replica, stacked on a leading (sharded) replica axis.

  Inside a step each replica sees its own slice. A distributed batch also
  has a `validity` (its padding `mask` and global `num_valid`).

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.get_strategy()
    >>> v = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: jnp.float32(ctx.replica_id_in_sync_group))
    >>> strategy.reduce("sum", v)
    Array(0., dtype=float32)
  """

  __slots__ = ("values", "packed")

  def __init__(self, values: Any, mask: Any = None, num_valid: Any = None, *,
               validity: Validity | None = None, packed: Any = None):
    self.values = values
    if validity is None and mask is not None:
      validity = Validity.pack(mask, num_valid)
    # The validity's one array, held as it is: what jax's pytree code reads
    # and rebuilds at every step call, without a `Validity` node in between.
    self.packed = packed if validity is None else validity.packed

  @property
  def validity(self) -> Validity | None:
    """The batch's `Validity` (mask and global count), or None."""
    return None if self.packed is None else Validity(self.packed)

  @property
  def mask(self):
    """Which rows of each replica's batch are real examples, or None."""
    return None if self.packed is None else self.validity.mask

  @property
  def num_valid(self):
    """The global number of real examples in the batch, or None."""
    return None if self.packed is None else self.validity.num_valid

  @property
  def num_replicas(self) -> int:
    """The length of the replica axis."""
    leaves = jax.tree.leaves(self.values)
    if not leaves:
      raise ValueError("PerReplica value has no array leaves.")
    return int(np.shape(leaves[0])[0])

  def replace(self, values: Any) -> "PerReplica":
    """Returns a PerReplica with new `values` and the same validity."""
    return PerReplica(values, packed=self.packed)

  def __iter__(self):
    """One `PerReplica` per part of a tuple or list batch, each with the
    batch's validity (`images, labels = next(iterator)`).

    Raises:
      TypeError: the values are not a tuple or list.
    """
    if not isinstance(self.values, (tuple, list)):
      raise TypeError(
          f"Cannot unpack a PerReplica of {type(self.values).__name__}: only "
          f"a batch of a tuple or list, such as (images, labels), unpacks. "
          f"Pass it to the step whole (strategy.run(fn, args=(batch,))) and "
          f"take it apart inside the step.")
    return iter([PerReplica(v, packed=self.packed) for v in self.values])

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda x: tuple(np.shape(x)), self.values)
    masked = "" if self.packed is None else ", masked"
    return f"PerReplica({shapes}{masked})"


# Flattened by jax's C++ pytree code (no Python call): a step's batch and its
# per-replica outputs cross every call of a compiled step.
jax.tree_util.register_dataclass(PerReplica, data_fields=("values", "packed"),
                                 meta_fields=())


class BatchGroup:
  """Several distributed batches stacked for one multi-step call.

  What `DistributedDataset.group(k)` yields and `jdist.multi_step` takes
  (leaves shaped `(num_replicas, steps, b, ...)`).

  Example:
    >>> import jdist, numpy as np
    >>> strategy = jdist.get_strategy()
    >>> data = [np.ones((4, 3), np.float32)] * 5
    >>> groups = list(strategy.experimental_distribute_dataset(data).group(2))
    >>> [g.num_steps for g in groups]
    [2, 2, 1]
  """

  __slots__ = ("values", "validity")

  def __init__(self, values: Any, validity: Validity | None = None):
    self.values = values
    self.validity = validity

  @property
  def num_steps(self) -> int:
    """How many batches (steps) the group holds."""
    leaves = jax.tree.leaves(self.values)
    if not leaves:
      raise ValueError("BatchGroup has no array leaves.")
    return int(np.shape(leaves[0])[1])

  def batch(self, i) -> PerReplica:
    """The `i`-th batch of the group (`i` may be traced), with its validity."""
    take = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
    validity = (None if self.validity is None else
                Validity(take(self.validity.packed)))
    return PerReplica(jax.tree.map(take, self.values), validity=validity)

  def merged(self, k: int) -> "BatchGroup":
    """The group with every `k` consecutive batches joined into one of
    `k * b` rows per replica (gradient accumulation), validity included.

    Raises:
      ValueError: the group's batches are not a multiple of `k`.
    """
    steps = self.num_steps
    if steps % k:
      raise ValueError(
          f"A group of {steps} batches cannot be joined {k} at a time.")
    if k == 1:
      return self

    def join(x):
      shape = np.shape(x)
      return x.reshape((shape[0], steps // k, k * shape[2]) + shape[3:])

    validity = None
    if self.validity is not None:
      packed = self.validity.packed
      r, b = np.shape(packed)[0], np.shape(packed)[2] - 1
      mask = packed[..., :b].reshape(r, steps // k, k * b)
      count = packed[..., b].reshape(r, steps // k, k).sum(axis=-1)
      validity = Validity(jnp.concatenate(
          [mask, count[..., None].astype(mask.dtype)], axis=-1))
    return BatchGroup(jax.tree.map(join, self.values), validity)

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda x: tuple(np.shape(x)), self.values)
    return f"BatchGroup({shapes}, steps={self.num_steps})"


jax.tree_util.register_dataclass(BatchGroup, data_fields=("values", "validity"),
                                 meta_fields=())


@jax.tree_util.register_pytree_node_class
class SyncOnRead(DistributedValue):
  """State kept per replica inside steps and aggregated when read outside.

  Inside a step `.value` is the replica's copy and `.assign(new)` returns
  the updated wrapper; outside, `.read()` aggregates.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> total = jdist.SyncOnRead(jnp.zeros(()), aggregation="sum")
    >>> strategy = jdist.get_strategy()
    >>> total = strategy.replicate(total)
    >>> float(total.read())
    0.0
  """

  __slots__ = ("value", "aggregation", "per_replica")

  def __init__(self, value: Any, aggregation="MEAN", per_replica: bool = False):
    self.value = value
    self.aggregation = VariableAggregation.of(aggregation)
    self.per_replica = bool(per_replica)

  def tree_flatten(self):
    return (self.value,), (self.aggregation, self.per_replica)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    obj.value = children[0]
    obj.aggregation, obj.per_replica = aux
    return obj

  def assign(self, value: Any) -> "SyncOnRead":
    """Returns a copy holding `value` (inside a step: this replica's value)."""
    return SyncOnRead(value, self.aggregation, self.per_replica)

  def read(self, replica_context=None) -> Any:
    """Aggregates over replicas (inside a step: all-reduces over
    `replica_context`, default the running step's)."""
    if not self.per_replica:
      return self.value
    agg = self.aggregation
    ctx = replica_context or context.current_replica_context()
    if ctx is not None:
      return _read_in_step(self.value, agg, ctx)
    if agg is VariableAggregation.SUM:
      return jax.tree.map(lambda x: jnp.sum(x, axis=0), self.value)
    if agg is VariableAggregation.MEAN:
      return jax.tree.map(lambda x: jnp.mean(x, axis=0), self.value)
    return jax.tree.map(lambda x: x[0], self.value)

  def replica_rows(self, num_replicas: int, xp=np) -> "SyncOnRead":
    """This unplaced value as `num_replicas` rows that read back as the value
    (SUM: the value on the first row, zeros on the others); `xp` is numpy or
    jax.numpy."""
    if self.per_replica:
      return self
    n = num_replicas
    def rows(x):
      x = xp.asarray(x)
      full = xp.broadcast_to(x, (n,) + x.shape)
      if self.aggregation is VariableAggregation.SUM:
        first = (xp.arange(n) == 0).reshape((n,) + (1,) * x.ndim)
        full = xp.where(first, full, xp.zeros_like(full))
      return full
    return SyncOnRead(jax.tree.map(rows, self.value), self.aggregation, True)

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda x: tuple(np.shape(x)), self.value)
    where = "per replica" if self.per_replica else "unplaced"
    return f"SyncOnRead({shapes}, {self.aggregation.name}, {where})"


@jax.tree_util.register_pytree_node_class
class Sharded(DistributedValue):
  """State split over the replicas along one axis of each leaf (ZeRO).

  Inside a step a replica sees its own blocks; outside, the leaves keep
  their unsharded shapes (a checkpoint restores on any device count).

  Attributes:
    value: the pytree of arrays (global outside a step, blocks inside).
    axes: for each leaf, the axis split over replicas, or None.
    axis_name: the mesh axis of the replicas.
    layouts: for each leaf, its `PartitionSpec` within a replica, or None.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> s = jdist.Sharded({"w": jnp.zeros((4, 8))}, (0,), "data",
    ...                   layouts=(P(None, "model"),))
    >>> s.partition_specs(), s.replica_specs()
    ((P('data', 'model'),), (P('data',),))
  """

  __slots__ = ("value", "axes", "axis_name", "layouts")

  def __init__(self, value: Any, axes: tuple, axis_name: str,
               layouts: tuple | None = None):
    self.value = value
    self.axes = tuple(axes)
    self.axis_name = axis_name
    self.layouts = None if layouts is None else tuple(
        P(*spec) for spec in layouts)

  def tree_flatten(self):
    return (self.value,), (self.axes, self.axis_name, self.layouts)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    obj.value = children[0]
    obj.axes, obj.axis_name, obj.layouts = aux
    return obj

  def replica_specs(self) -> tuple:
    """One `PartitionSpec` per leaf naming the replica axis alone: what a
    step's `shard_map` (manual over that axis only) takes and returns."""
    return tuple(P() if a is None else P(*([None] * a), self.axis_name)
                 for a in self.axes)

  def partition_specs(self) -> tuple:
    """One `PartitionSpec` per leaf of `value`, in flattening order: where
    each leaf lies on the whole mesh (the replica axis and the layout)."""
    if self.layouts is None:
      return self.replica_specs()
    return tuple(_with_replica_axis(layout, a, self.axis_name)
                 for layout, a in zip(self.layouts, self.axes))

  def replace(self, value: Any) -> "Sharded":
    """Returns a `Sharded` holding `value` with the same layout."""
    return Sharded(value, self.axes, self.axis_name, self.layouts)

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda x: tuple(np.shape(x)), self.value)
    return f"Sharded({shapes}, axes={self.axes})"


def _with_replica_axis(layout: P, axis: int | None, axis_name: str) -> P:
  """`layout` with dimension `axis` also split over `axis_name`, outermost."""
  if axis is None:
    return layout
  dims = list(layout) + [None] * max(0, axis + 1 - len(layout))
  within = dims[axis]
  if within is None:
    dims[axis] = axis_name
  else:
    dims[axis] = (axis_name,) + (tuple(within) if isinstance(
        within, (tuple, list)) else (within,))
  return P(*dims)


def _read_in_step(value: Any, agg: VariableAggregation, ctx) -> Any:
  if agg is VariableAggregation.ONLY_FIRST_REPLICA:
    first = ctx.replica_id_in_sync_group == 0
    return ctx.all_reduce("sum", jax.tree.map(
        lambda x: jnp.where(first, x, jnp.zeros_like(x)), value))
  return ctx.all_reduce(agg.name, value)


class RemoteState(abc.ABC):
  """State held away from this process's devices (`ServerVariables`)."""

  @abc.abstractmethod
  def read(self) -> Any:
    """The values, on the host."""


def read_value(tree: Any) -> Any:
  """Every `SyncOnRead` in `tree` aggregated, every `jdist.ServerVariables`
  read (a metric stays a metric).

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> jdist.read_value({"n": jdist.SyncOnRead(jnp.ones(()), "sum")})
    {'n': Array(1., dtype=float32)}
  """
  def one(x):
    if isinstance(x, RemoteState):
      return x.read()
    return x.read() if isinstance(x, SyncOnRead) else x
  return jax.tree.map(
      one, tree, is_leaf=lambda x: isinstance(x, (SyncOnRead, RemoteState)))


def is_distributed(x: Any) -> bool:
  """Whether `x` is a `DistributedValue` (for `is_leaf=` of pytree functions)."""
  return isinstance(x, DistributedValue)


@dataclasses.dataclass(frozen=True)
class ValueContext:
  """What `experimental_distribute_values_from_function` tells `value_fn`."""

  replica_id_in_sync_group: int = 0
  num_replicas_in_sync: int = 1
