"""A step's arguments as a plan compiles them: shapes, dtypes and layouts."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.core.values import PerReplica
from jdist._src.input import host

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def laid_out(strategy, state: Any) -> Any:
  """`state` as `jax.ShapeDtypeStruct` values with each leaf's own layout (on
  the strategy's devices) or the one the strategy gives its state."""
  devices = set(strategy.mesh.devices.flat)
  shardings = strategy.shardings(state)

  def one(x, sharding):
    own = getattr(x, "sharding", None)
    if isinstance(own, NamedSharding) and own.device_set == devices:
      sharding = own
    return jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=sharding)

  return jax.tree.map(one, state, shardings)


def shapes(state: Any) -> Any:
  """`state`'s shapes and dtypes alone (no layout), to lay out anew.

  Raises:
    ValueError: the state holds a `jdist.Sharded`, which no other layout
      takes as is.
  """
  if any(kinds.has_layouts(x) for x in jax.tree.leaves(
      state, is_leaf=kinds.has_layouts)):
    raise ValueError(
        "the state holds optimizer state split over this strategy's "
        "replicas (jdist.ShardedOptimizer), made for this layout only")
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)),
                      state)


def _dtype(x: Any):
  dtype = getattr(x, "dtype", None)
  return dtype if dtype is not None else jax.dtypes.canonicalize_dtype(
      np.result_type(x))


def distributed_batch(strategy, batch: Any) -> PerReplica:
  """The abstract `PerReplica` the strategy's distributed dataset makes of a
  global `batch` (a `PerReplica` is taken as it is).

  Raises:
    ValueError: the leaves disagree on the batch size, or it does not
      split over the replicas (and, for FSDP, each replica's devices).
  """
  if kinds.is_node(batch):  # distributed already
    return batch
  sizes = {np.shape(x)[0] if np.ndim(x) else None
           for x in jax.tree.leaves(batch)}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
        "The batch must be a pytree of arrays that share a leading batch "
        f"axis (the global batch); its leaves' leading sizes are {sizes}.")
  size, n = sizes.pop(), strategy.num_replicas_in_sync
  if size % n:
    raise host.split_error(size, n)
  inner = strategy.replica_batch_axis
  k = 1 if inner is None else dict(strategy.mesh.shape)[inner]
  if (size // n) % k:
    raise host.split_error(size, n * k,
                           f"parts ({n} replicas x {k} devices of {inner!r})")
  mesh, axis = strategy.mesh, strategy.axis_name
  rows = placement.per_replica_sharding(mesh, axis, inner)
  values = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (n, size // n) + tuple(np.shape(x)[1:]), _dtype(x), sharding=rows),
                        batch)
  packed = jax.ShapeDtypeStruct((n, size // n + 1), np.int32,
                                sharding=placement.per_replica_sharding(
                                    mesh, axis))
  return PerReplica(values, packed=packed)


def global_batch(batch: Any) -> Any:
  """The global batch of `batch` as `ShapeDtypeStruct` values."""
  if not kinds.is_node(batch):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x),
                                                       _dtype(x)), batch)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[0] * x.shape[1],) + tuple(x.shape[2:]), x.dtype),
                      kinds.kind_of(batch).payload(batch))


def parse_bytes(budget: Any) -> int | None:
  """A memory budget as bytes: a number, or a string with a unit
  ("16GB", "512 MiB"); None stays None.

  Example:
    >>> from jdist._src.planning.inputs import parse_bytes
    >>> parse_bytes("1.5 GB"), parse_bytes("2 KiB"), parse_bytes(1000)
    (1500000000, 2048, 1000)

  Raises:
    ValueError: not a positive size.
  """
  if budget is None:
    return None
  if isinstance(budget, str):
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([A-Za-z]*)\s*", budget)
    unit = m and _UNITS.get(m.group(2).lower())
    if unit is None:
      raise ValueError(
          f"memory_budget {budget!r} is not a size: give bytes (an int) or a "
          "number with a unit, such as '16GB' or '512MiB'.")
    budget = float(m.group(1)) * unit
  if isinstance(budget, bool) or not isinstance(budget, (int, float)) or (
      budget <= 0):
    raise ValueError(f"memory_budget must be a positive number of bytes, got "
                     f"{budget!r}.")
  return int(budget)
