"""The plan of a step's inputs: how each argument enters `jax.shard_map`.

`DistributedFunction` traces a step under `jax.jit`; its arguments are then
tracers (arrays), distributed values (`PerReplica`, `SyncOnRead`), or other
Python values. The plan sorts every flattened argument into an `ArgKind`,
lists the global arrays the `shard_map` takes with their partition specs, and,
inside the map, rebuilds each replica's view of the arguments.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdist._src.core.validity import Validity
from jdist._src.core.values import (BatchGroup, PerReplica, Sharded,
                                    SyncOnRead, is_distributed)
from jdist._src.errors import StrategyMismatchError


class ArgKind(enum.Enum):
  """How one flattened argument of a step reaches the replicas."""

  MIRRORED = "mirrored"          # an array, whole on every replica: P()
  PER_REPLICA = "per_replica"    # a PerReplica: each replica gets its row
  SYNC_ON_READ = "sync_on_read"  # a SyncOnRead: each replica its own copy
  SHARDED = "sharded"            # a Sharded: each replica its blocks
  STATIC = "static"              # not an array under jit: a program constant


@dataclasses.dataclass(frozen=True)
class Slot:
  """One flattened argument: its kind and what rebuilds it inside the map.

  Attributes:
    kind: the `ArgKind`.
    count: how many `shard_map` inputs it takes.
    treedef: PER_REPLICA and SYNC_ON_READ: the structure of those inputs.
    value: STATIC: the value itself; SYNC_ON_READ: the `SyncOnRead` (for its
      aggregation); SHARDED: the `Sharded` (for its layout).
  """

  kind: ArgKind
  count: int
  treedef: Any = None
  value: Any = None


def _check_replica_axis(tree: Any, n: int, what: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != n:
      got = "a scalar" if not shape else f"a leading axis of {shape[0]}"
      raise StrategyMismatchError(
          f"{what} leaf {jax.tree_util.keystr(path) or '<value>'} has {got}, but "
          f"this strategy has {n} replicas. The value was distributed by a "
          "different strategy; distribute it again with this strategy (for "
          "example strategy.experimental_distribute_dataset).")


def _check_sharded(node: Sharded, strategy) -> None:
  n = strategy.num_replicas_in_sync
  if node.axis_name != strategy.axis_name:
    raise StrategyMismatchError(
        f"A Sharded value split over the mesh axis {node.axis_name!r} was "
        f"passed to a step of a strategy whose axis is {strategy.axis_name!r}. "
        "Initialise the optimizer state with this strategy.")
  flat = jax.tree_util.tree_flatten_with_path(node.value)[0]
  for (path, leaf), axis in zip(flat, node.axes):
    if axis is not None and jnp.shape(leaf)[axis] % n:
      raise StrategyMismatchError(
          f"Sharded leaf {jax.tree_util.keystr(path) or '<value>'} of shape "
          f"{jnp.shape(leaf)} cannot be split over this strategy's {n} "
          f"replicas along axis {axis}: it was laid out for another number of "
          "replicas. Initialise the optimizer state with this strategy, or "
          "restore it from a checkpoint onto it.")


def _is_static(x: Any) -> bool:
  """Under jit every array argument is a tracer; the rest are static values."""
  return not isinstance(x, jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How a call's arguments enter the step's `shard_map`.

  Attributes:
    in_tree: the structure of `(args, kwargs)`, distributed values as leaves.
    slots: one `Slot` per flattened argument.
    leaves: the global arrays the `shard_map` takes, in order.
    specs: their partition specs.
    validity: the `Validity` of the step's distributed batch (the first
      `PerReplica` that has one), fed as the last input; or None.
  """

  in_tree: Any
  slots: tuple
  leaves: tuple
  specs: tuple
  validity: Validity | None

  @classmethod
  def of(cls, strategy, args: tuple, kwargs: dict) -> "InputPlan":
    """Plans the call `fn(*args, **kwargs)` (traced under jit) on `strategy`."""
    n = strategy.num_replicas_in_sync
    replicas = P(strategy.axis_name)
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs),
                                               is_leaf=is_distributed)
    if any(isinstance(x, BatchGroup) for x in jax.tree.leaves(
        (args, kwargs), is_leaf=lambda x: isinstance(x, BatchGroup))):
      raise TypeError(
          "A step got a BatchGroup (several batches stacked, from "
          "DistributedDataset.group). A step runs one batch: pass the group "
          "to jdist.multi_step(step), which runs the step once per batch in "
          "one compiled call, or iterate the dataset without group().")
    slots, leaves, specs, validity = [], [], [], None
    for node in flat:
      if isinstance(node, PerReplica):
        _check_replica_axis(node.values, n, "PerReplica")
        sub, treedef = jax.tree_util.tree_flatten(node.values)
        slots.append(Slot(ArgKind.PER_REPLICA, len(sub), treedef))
        leaves.extend(sub)
        specs.extend([replicas] * len(sub))
        if validity is None:
          validity = node.validity
      elif isinstance(node, SyncOnRead):
        node = node.replica_rows(n, jnp)
        _check_replica_axis(node.value, n, "SyncOnRead")
        sub, treedef = jax.tree_util.tree_flatten(node.value)
        slots.append(Slot(ArgKind.SYNC_ON_READ, len(sub), treedef, node))
        leaves.extend(sub)
        specs.extend([replicas] * len(sub))
      elif isinstance(node, Sharded):
        _check_sharded(node, strategy)
        sub, treedef = jax.tree_util.tree_flatten(node.value)
        slots.append(Slot(ArgKind.SHARDED, len(sub), treedef, node))
        leaves.extend(sub)
        specs.extend(node.partition_specs())
      elif _is_static(node):
        slots.append(Slot(ArgKind.STATIC, 0, value=node))
      else:
        slots.append(Slot(ArgKind.MIRRORED, 1))
        leaves.append(node)
        specs.append(P())
    if validity is not None:  # the batch's rows: mask, then the count
      leaves.append(validity.packed)
      specs.append(replicas)
    return cls(in_tree, tuple(slots), tuple(leaves), tuple(specs), validity)

  def local_arguments(self, local: tuple) -> tuple:
    """Inside the map: `(args, kwargs, validity)` as this replica sees them.

    Args:
      local: this replica's blocks of `leaves` (replica axis of length 1).
    """
    pos, nodes = 0, []
    for slot in self.slots:
      chunk, pos = local[pos:pos + slot.count], pos + slot.count
      if slot.kind is ArgKind.STATIC:
        nodes.append(slot.value)
      elif slot.kind is ArgKind.MIRRORED:
        nodes.append(chunk[0])
      elif slot.kind is ArgKind.SHARDED:  # blocks keep their axes
        nodes.append(slot.value.replace(
            jax.tree_util.tree_unflatten(slot.treedef, chunk)))
      else:
        own = [x[0] for x in chunk]  # drop the replica axis
        tree = jax.tree_util.tree_unflatten(slot.treedef, own)
        if slot.kind is ArgKind.PER_REPLICA:
          nodes.append(tree)
        else:
          nodes.append(SyncOnRead(tree, slot.value.aggregation, True))
    validity = None
    if self.validity is not None:
      validity = Validity(local[pos]).replica(0)
    args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, nodes)
    return args, kwargs, validity
