"""Reductions outside steps: reduce, gather and local results of a step's outputs.

The arithmetic is pure, so it also serves `merge_call` (traced values);
outside steps it runs under `jax.jit` with a replicated output, readable on
every process.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.core import kinds
from jdist._src.core import mesh_context
from jdist._src.core import placement
from jdist._src.core.reduce_op import ReduceOp
from jdist._src.core.validity import Validity
from jdist._src.errors import DoubleReductionError, StrategyMismatchError


def _is_batch_axis(x, rows, axis) -> bool:
  """Whether `axis` of each replica's value is its batch of `rows` examples."""
  return (rows is not None and axis == 0 and x.ndim >= 2 and
          x.shape[1] == rows)


def reduce_stacked(op: ReduceOp, x, mask, num_valid, axis):
  """Reduces a stacked `(R, ...)` leaf over replicas (and `axis` of each)."""
  x = jnp.asarray(x)
  if axis is None:
    if mask is None:
      return _plain(op, x, (0,))
    # Weight replicas by their valid examples; replicas holding only padding
    # of a short last batch do not count.
    counts = jnp.sum(mask, axis=1)
    shape = (-1,) + (1,) * (x.ndim - 1)
    if op is ReduceOp.MEAN:
      w = (counts / jnp.maximum(jnp.sum(counts), 1)).reshape(shape)
      return jnp.sum(jnp.where(w > 0, x * w, 0), axis=0).astype(x.dtype)
    has = (counts > 0).reshape(shape)
    if op is ReduceOp.SUM:
      return jnp.sum(jnp.where(has, x, 0), axis=0)
    return _plain(op, jnp.where(has, x, _identity(op, x.dtype)), (0,))
  if axis < 0:
    axis += x.ndim - 1
  if not 0 <= axis < x.ndim - 1:
    raise ValueError(
        f"axis={axis} is out of range for per-replica values of rank "
        f"{x.ndim - 1}.")
  if not _is_batch_axis(x, None if mask is None else mask.shape[1], axis):
    return _plain(op, x, (0, axis + 1))
  m = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
  if op is ReduceOp.MEAN:
    total = jnp.sum(jnp.where(m, x, 0), axis=(0, 1))
    return (total / jnp.maximum(num_valid, 1)).astype(x.dtype)
  if op is ReduceOp.SUM:
    return jnp.sum(jnp.where(m, x, 0), axis=(0, 1))
  return _plain(op, jnp.where(m, x, _identity(op, x.dtype)), (0, 1))


def _plain(op: ReduceOp, x, axes):
  fn = {ReduceOp.SUM: jnp.sum, ReduceOp.MEAN: jnp.mean,
        ReduceOp.MAX: jnp.max, ReduceOp.MIN: jnp.min}[op]
  return fn(x, axis=axes)


def _identity(op: ReduceOp, dtype):
  if jnp.issubdtype(dtype, jnp.floating):
    return -jnp.inf if op is ReduceOp.MAX else jnp.inf
  info = jnp.iinfo(dtype)
  return info.min if op is ReduceOp.MAX else info.max


def reduce_mirrored(op: ReduceOp, x, axis):
  """Reduction of a value that is the same on every replica."""
  if op is ReduceOp.SUM:
    raise DoubleReductionError(
        "strategy.reduce(SUM, ...) of a mirrored value (one that is already the "
        "same on every replica, for example a gradient or a value all-reduced "
        "inside the step): summing it over replicas would multiply it by the "
        "number of replicas. Return the per-replica value from the step and "
        "reduce that, or use MEAN.")
  x = jnp.asarray(x)
  return x if axis is None else _plain(op, x, (axis,))


def gather_stacked(x, axis: int):
  """Concatenates a stacked `(R, ...)` leaf's replicas along `axis`."""
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(
        "gather needs per-replica values with at least one axis; got per-replica "
        "scalars. Use strategy.experimental_local_results or reduce instead.")
  axis = axis % (x.ndim - 1)
  moved = jnp.moveaxis(x, 0, axis)
  shape = moved.shape[:axis] + (-1,) + moved.shape[axis + 2:]
  return moved.reshape(shape)


def _unpack(validity: Validity | None):
  return (None, None) if validity is None else (validity.mask,
                                                validity.num_valid)


@functools.lru_cache(maxsize=None)
def _compiled(mesh, what: str, op, axis):
  out = placement.replicated_sharding(mesh)
  if what == "reduce":
    fn = lambda x, validity: reduce_stacked(op, x, *_unpack(validity), axis)
  elif what == "reduce_mirrored":
    fn = lambda x, validity: reduce_mirrored(op, x, axis)
  elif what == "gather":
    fn = lambda x, validity: gather_stacked(x, axis)
  else:  # "replicate": a copy every process can read
    fn = lambda x, validity: x
  return jax.jit(mesh_context.on_mesh(mesh, f"strategy.{what}", fn),
                 out_shardings=out)


def _traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _check_owner(strategy, rows: Any, what: str) -> None:
  """Raises unless the replica rows `rows` live on `strategy`'s replicas."""
  leaves = [x for x in jax.tree.leaves(rows)
            if isinstance(x, jax.Array) and not _traced(x)]
  if not leaves:
    return
  x = leaves[0]
  n = strategy.num_replicas_in_sync
  devices = x.sharding.device_set
  if np.shape(x)[:1] == (n,) and devices == set(strategy.mesh.devices.flat):
    return
  described = ", ".join(f"{d.platform}:{d.id}" for d in sorted(
      devices, key=lambda d: d.id))
  raise StrategyMismatchError(
      f"strategy.{what} got a value whose {np.shape(x)[0]} replicas live on "
      f"[{described}], not on the replicas of {strategy!r}. A step's outputs "
      "belong to the strategy that ran the step: call that strategy's "
      f"{what}.")


def _by_kind(value: Any, on_rows, on_global) -> Any:
  """`value` with `on_rows(tree, validity)` applied to each node held as
  replica rows, `on_global(payload)` to the others."""
  def one(node):
    kind = kinds.kind_of(node)
    rows = kind.rows(node)
    return on_global(kind.payload(node)) if rows is None else on_rows(*rows)
  return jax.tree.map(one, value, is_leaf=kinds.is_node)


def _replica_ids(value: Any) -> range:
  """The replicas of the rows `value` holds (all of them: fetched values)."""
  for node in jax.tree.leaves(value, is_leaf=kinds.is_node):
    rows = kinds.kind_of(node).rows(node)
    if rows is not None and jax.tree.leaves(rows[0]):
      return range(np.shape(jax.tree.leaves(rows[0])[0])[0])
  return range(0)


def _pick(value: Any, i: int, row) -> Any:
  """Replica `i`'s values of `value` (`row(x, i)` of each leaf of its rows)."""
  def one(node):
    rows = kinds.kind_of(node).rows(node)
    if rows is None:
      return node
    return jax.tree.map(lambda x: row(x, i), rows[0])
  return jax.tree.map(one, value, is_leaf=kinds.is_node)


def _padding_dropped(out, x, validity: Validity | None, axis: int, keep):
  """`out`, the gathered leaf `x`, without its padding rows (`keep()`)."""
  batch_rows = None if validity is None else validity.batch_size
  if _is_batch_axis(x, batch_rows, axis % max(x.ndim - 1, 1)):
    rows = keep()
    if rows.size != out.shape[0]:
      out = jnp.take(out, rows, axis=0) if isinstance(out, jax.Array) \
          else out[rows]
  return out


def reduce(strategy, op, value: Any, axis=None) -> Any:
  """See `Strategy.reduce`."""
  op = ReduceOp.of(op)

  def stacked(tree, validity):
    _check_owner(strategy, tree, "reduce")
    def leaf(x):
      if _traced(x):
        return reduce_stacked(op, x, *_unpack(validity), axis)
      return _compiled(strategy.mesh, "reduce", op, axis)(x, validity)
    return jax.tree.map(leaf, tree)

  def mirrored(x):
    if op is ReduceOp.SUM or _traced(x) or not isinstance(x, jax.Array):
      return reduce_mirrored(op, x, axis)
    if axis is None:
      return x
    return _compiled(strategy.mesh, "reduce_mirrored", op, axis)(x, None)

  return _by_kind(value, stacked, lambda x: jax.tree.map(mirrored, x))


def gather(strategy, value: Any, axis: int = 0) -> Any:
  """See `Strategy.gather`."""
  n = strategy.num_replicas_in_sync

  def stacked(tree, validity):
    _check_owner(strategy, tree, "gather")
    keep = []  # rows to keep, read from the validity at most once per value

    def kept():
      if not keep:
        host = placement.to_host(_compiled(
            strategy.mesh, "replicate", None, None)(validity, None))
        keep.append(np.flatnonzero(host.mask.reshape(-1)))
      return keep[0]

    def leaf(x):
      if _traced(x):
        return gather_stacked(x, axis)
      out = placement.host_local(
          _compiled(strategy.mesh, "gather", None, axis)(x, None))
      return _padding_dropped(out, x, validity, axis, kept)
    return jax.tree.map(leaf, tree)

  return _by_kind(value, stacked, lambda tree: jax.tree.map(
      lambda x: jnp.concatenate([jnp.asarray(x)] * n, axis=axis), tree))


def local_results(strategy, value: Any) -> tuple:
  """See `Strategy.experimental_local_results`."""
  ids = placement.local_replica_ids(strategy.mesh, strategy.axis_name)
  for node in jax.tree.leaves(value, is_leaf=kinds.is_node):
    rows = kinds.kind_of(node).rows(node)
    if rows is not None:
      _check_owner(strategy, rows[0], "experimental_local_results")
  return tuple(_pick(value, i, _row) for i in ids)


def _row(x, i: int):
  if _traced(x) or not isinstance(x, jax.Array):
    return x[i]
  return placement.local_shards(x)[i]


# --- values fetched to the host, which no strategy's devices hold: the
# results a parameter-server coordinator fetched from its workers ---


def reduce_fetched(op, value: Any, axis=None) -> Any:
  """`reduce` of fetched values, on the host: numpy results.

  Raises:
    jdist.DoubleReductionError: SUM of a mirrored value.
  """
  op = ReduceOp.of(op)
  return _by_kind(
      value,
      lambda tree, validity: jax.tree.map(lambda x: np.asarray(reduce_stacked(
          op, x, *_unpack(validity), axis)), tree),
      lambda tree: jax.tree.map(
          lambda x: np.asarray(reduce_mirrored(op, x, axis)), tree))


def gather_fetched(value: Any, axis: int = 0) -> Any:
  """`gather` of fetched values, on the host (padding rows dropped; a global
  value as it is)."""
  def stacked(tree, validity):
    kept = lambda: np.flatnonzero(np.asarray(validity.mask).reshape(-1))
    return jax.tree.map(lambda x: _padding_dropped(
        np.asarray(gather_stacked(x, axis)), np.asarray(x), validity, axis,
        kept), tree)
  return _by_kind(value, stacked, lambda tree: tree)


def local_results_fetched(value: Any) -> tuple:
  """`experimental_local_results` of fetched values, one entry per replica."""
  ids = _replica_ids(value)
  return (tuple(_pick(value, i, lambda x, i: x[i]) for i in ids) if ids
          else (value,))
