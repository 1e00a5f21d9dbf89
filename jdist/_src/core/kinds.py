"""Value kinds: what the engine does with each kind of value, in one table.

Each kind of leaf says once, in a `ValueKind`, how it crosses a step and
what it is outside steps; `plan.py` and `probe.py` ask it and know no kind
(ARCHITECTURE.md, "Value kinds"). The map is manual over the replica axis
only, so a kind's specs name that axis alone. A new kind is one
`DistributedValue` class and one `register(cls, kind)` here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._src.core import in_step
from jdist._src.core import placement
from jdist._src.core.validity import Validity
from jdist._src.core.values import BatchGroup, PerReplica, Sharded, SyncOnRead
from jdist._src.errors import StrategyMismatchError


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What one argument feeds the step's `shard_map`: global arrays, one
  `PartitionSpec` each, and what `ValueKind.local` rebuilds it from (`aux`)."""

  leaves: tuple
  specs: tuple
  aux: Any = None


class ValueKind:
  """How one kind of value enters a step, is seen in it, and leaves it.

  Subclasses override what applies to them (`STATIC` has no output side).
  """

  name = "value"
  # Whether a value of this kind is itself a value inside the step (so a
  # step may return one, kept whole): SyncOnRead and Sharded, not PerReplica
  # (the step sees its rows' plain values).
  kept_in_step = False
  # Whether a checkpoint names the leaves of a value of this kind as those of
  # its payload, with no level of its own: sharded optimizer state is named
  # as the mirrored state it equals, so either checkpoint loads into the other.
  named_as_payload = False

  # --- into the map -----------------------------------------------------------

  def inputs(self, x: Any, strategy) -> Inputs:
    """The `shard_map` inputs of argument `x` (checked against `strategy`)."""
    raise TypeError(f"A {self.name} cannot be passed to a step.")

  def local(self, aux: Any, blocks: Sequence) -> Any:
    """Inside the map: the argument as one replica sees it, rebuilt from
    `Inputs.aux` and this replica's blocks of `Inputs.leaves`."""
    raise NotImplementedError(self.name)

  def validity(self, x: Any) -> Validity | None:
    """The validity of the batch `x` is (fed to the step), or None."""
    del x
    return None

  def needs_placing(self, x: Any) -> bool:
    """Whether `x` must be placed on the replicas before the step sees it."""
    del x
    return False

  def place(self, x: Any, strategy) -> Any:
    """`x` placed on the replicas (see `needs_placing`)."""
    del strategy
    return x

  # --- out of the map ---------------------------------------------------------

  def out_aux(self, x: Any) -> Any:
    """What `out_specs` and `wrap` need of the traced output `x`."""
    del x
    return None

  def out_specs(self, aux: Any, axis: str) -> Any:
    """The `shard_map` out spec (a prefix of `result`'s structure)."""
    raise NotImplementedError(self.name)

  def result(self, x: Any, axis: str) -> Any:
    """Inside the map: the replica's arrays for the traced output `x`."""
    raise NotImplementedError(self.name)

  def wrap(self, aux: Any, arrays: Any, validity: Validity | None) -> Any:
    """Outside the map: the output as the caller gets it."""
    raise NotImplementedError(self.name)

  # --- outside a step ---------------------------------------------------------

  def payload(self, x: Any) -> Any:
    """The pytree of arrays `x` holds (without its layout or validity)."""
    return x

  def rows(self, x: Any):
    """`(tree, validity)`: `x` as rows stacked on a leading replica axis, or
    None when `x` is one global value (mirrored, unplaced or sharded)."""
    del x
    return None

  def with_rows(self, x: Any, tree: Any, validity: Validity | None = None):
    """`x` holding the replica rows `tree` instead (see `rows`)."""
    raise NotImplementedError(self.name)

  def replicate(self, x: Any, strategy) -> Any:
    """`x` placed as `strategy.replicate` places it."""
    put, mesh = strategy.state_placement.put, strategy.mesh
    return jax.tree.map(lambda leaf: put(leaf, mesh), x)

  def read(self, x: Any) -> Any:
    """What a reader outside a step sees of `x` (`jdist.read_value`)."""
    return x

  def aggregation(self, x: Any):
    """The `VariableAggregation` by which `x` is read, or None."""
    del x
    return None

  def unplaced(self, x: Any) -> Any:
    """`x` as a value placed nowhere (how parameter servers store it)."""
    return x

  def layouts(self, x: Any) -> tuple | None:
    """A `PartitionSpec` over the whole mesh per leaf of `payload(x)`, when
    `x` carries its own layout; None when the strategy lays it out."""
    del x
    return None

  def batch_spec(self, x: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of one replica's batch (one step's) in `x`."""
    raise TypeError(f"A {self.name} holds no batch.")


def _check_stacked(leaves: Sequence, n: int, what: str) -> None:
  """Raises unless every `(path, leaf)` has a leading axis of `n` replicas."""
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != n:
      got = "a scalar" if not shape else f"a leading axis of {shape[0]}"
      raise StrategyMismatchError(
          f"{what} leaf {jax.tree_util.keystr(path) or '<value>'} has {got}, but "
          f"this strategy has {n} replicas. The value was distributed by a "
          "different strategy; distribute it again with this strategy (for "
          "example strategy.experimental_distribute_dataset).")


def _rows_in(tree: Any, strategy, what: str) -> Inputs:
  """A tree of `(R, ...)` rows, each replica fed its own row."""
  n = strategy.num_replicas_in_sync
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  _check_stacked(with_path, n, what)
  leaves = tuple(leaf for _, leaf in with_path)
  return Inputs(leaves, (P(strategy.axis_name),) * len(leaves), treedef)


def _own_rows(treedef, blocks: Sequence) -> Any:
  """This replica's rows without the replica axis."""
  return jax.tree_util.tree_unflatten(treedef, [b[0] for b in blocks])


def _varying_row(x: Any, axis: str) -> jax.Array:
  """A replica's value as its row of a per-replica output."""
  return in_step.to_varying(x, axis)[None]


class _Mirrored(ValueKind):
  """An array that is the same on every replica: fed whole, `P()`."""

  name = "mirrored array"

  def inputs(self, x, strategy):
    del strategy
    return Inputs((x,), (P(),))

  def local(self, aux, blocks):
    return blocks[0]

  def out_specs(self, aux, axis):
    return P()

  def result(self, x, axis):
    return jnp.asarray(x)

  def wrap(self, aux, arrays, validity):
    return arrays


class _Static(ValueKind):
  """A Python value under jit's trace: compiled into the program."""

  name = "static value"

  def inputs(self, x, strategy):
    del strategy
    return Inputs((), (), x)

  def local(self, aux, blocks):
    return aux



class _PerReplica(ValueKind):
  """One value per replica (`PerReplica`); as an output, an array that varies
  over the replicas."""

  name = "PerReplica"

  def inputs(self, x, strategy):
    return _rows_in(x.values, strategy, "PerReplica")

  def local(self, aux, blocks):
    return _own_rows(aux, blocks)

  def validity(self, x):
    return x.validity

  def is_output(self, x, axis) -> bool:
    """Whether the traced array `x` varies over the replicas."""
    return in_step.is_varying(x, axis)

  def out_specs(self, aux, axis):
    return P(axis)

  def result(self, x, axis):
    return _varying_row(x, axis)

  def wrap(self, aux, arrays, validity):
    return PerReplica(arrays, validity=validity)

  def payload(self, x):
    return x.values

  def rows(self, x):
    return x.values, x.validity

  def with_rows(self, x, tree, validity=None):
    return PerReplica(tree, validity=validity)

  def replicate(self, x, strategy):
    return x  # already on the replicas

  def batch_spec(self, x):
    return _spec_after(x.values, 1)


class _SyncOnRead(ValueKind):
  """Each replica's own copy (`SyncOnRead`), kept whole through the step."""

  name = "SyncOnRead"
  kept_in_step = True

  def inputs(self, x, strategy):
    # Unplaced (made outside a step): placed in the program, so that the
    # step may also be lowered or traced for it.
    x = x.replica_rows(strategy.num_replicas_in_sync, jnp)
    entered = _rows_in(x.value, strategy, "SyncOnRead")
    return dataclasses.replace(entered, aux=(entered.aux, x.aggregation))

  def local(self, aux, blocks):
    treedef, aggregation = aux
    return SyncOnRead(_own_rows(treedef, blocks), aggregation, True)

  def needs_placing(self, x):
    return not x.per_replica

  def place(self, x, strategy):
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(x.value)):
      # Under the caller's own jax.jit: rows computed in its program.
      return x.replica_rows(strategy.num_replicas_in_sync, jnp)
    return strategy.replicate(x)

  def out_aux(self, x):
    return x.aggregation

  def out_specs(self, aux, axis):
    return P(axis)

  def result(self, x, axis):
    return jax.tree.map(lambda v: _varying_row(v, axis), x.value)

  def wrap(self, aux, arrays, validity):
    return SyncOnRead(arrays, aux, True)

  def payload(self, x):
    return x.value

  def rows(self, x):
    return (x.value, None) if x.per_replica else None

  def with_rows(self, x, tree, validity=None):
    return x.assign(tree)

  def replicate(self, x, strategy):
    if x.per_replica:
      return x
    n, mesh, axis = (strategy.num_replicas_in_sync, strategy.mesh,
                     strategy.axis_name)
    rows = x.replica_rows(n, np)
    ids = list(placement.local_replica_ids(mesh, axis))
    return SyncOnRead(placement.put_per_replica(
        jax.tree.map(lambda v: v[ids], rows.value), mesh, axis, n),
                      x.aggregation, True)

  def read(self, x):
    return x.read()

  def aggregation(self, x):
    return x.aggregation

  def unplaced(self, x):
    return SyncOnRead(x.read(), x.aggregation)


class _Sharded(ValueKind):
  """State split over the replicas (`Sharded`): each replica its blocks.

  Its specs name the replica axis alone; a layout within a replica travels
  with the arrays' own shardings."""

  name = "Sharded"
  kept_in_step = True
  named_as_payload = True

  def inputs(self, x, strategy):
    _check_sharded(x, strategy)
    leaves, treedef = jax.tree_util.tree_flatten(x.value)
    return Inputs(tuple(leaves), x.replica_specs(), (treedef, x))

  def local(self, aux, blocks):
    treedef, layout = aux
    return layout.replace(jax.tree_util.tree_unflatten(treedef, blocks))

  def out_aux(self, x):
    return jax.tree_util.tree_structure(x.value), x

  def out_specs(self, aux, axis):
    return list(aux[1].replica_specs())

  def result(self, x, axis):
    return [jnp.asarray(v) for v in jax.tree.leaves(x.value)]

  def wrap(self, aux, arrays, validity):
    treedef, layout = aux
    return layout.replace(jax.tree_util.tree_unflatten(treedef, arrays))

  def payload(self, x):
    return x.value

  def replicate(self, x, strategy):
    return x  # already laid out over the replicas

  def layouts(self, x):
    return x.partition_specs()


class _BatchGroup(ValueKind):
  """Several batches for one multi-step call: never a step's argument."""

  name = "BatchGroup"

  def inputs(self, x, strategy):
    raise TypeError(
        "A step got a BatchGroup (several batches stacked, from "
        "DistributedDataset.group). A step runs one batch: pass the group "
        "to jdist.multi_step(step), which runs the step once per batch in "
        "one compiled call, or iterate the dataset without group().")

  def payload(self, x):
    return x.values

  def batch_spec(self, x):
    return _spec_after(x.values, 2)


def _spec_after(tree: Any, skip: int) -> Any:
  """`tree`'s leaves as `jax.ShapeDtypeStruct`s without their first `skip`
  axes."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[skip:], x.dtype),
                      tree)


def _check_sharded(node: Sharded, strategy) -> None:
  n = strategy.num_replicas_in_sync
  if node.axis_name != strategy.axis_name:
    raise StrategyMismatchError(
        f"A Sharded value split over the mesh axis {node.axis_name!r} was "
        f"passed to a step of a strategy whose axis is {strategy.axis_name!r}. "
        "Initialise the optimizer state with this strategy.")
  if node.layouts is not None:
    named = {a for spec in node.layouts for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    missing = sorted(named - set(strategy.mesh.axis_names))
    if missing:
      raise StrategyMismatchError(
          f"A Sharded value laid out over the mesh axes {missing} was passed "
          f"to a step of a strategy whose mesh has the axes "
          f"{tuple(strategy.mesh.axis_names)}. Initialise the optimizer state "
          "with this strategy, or restore it from a checkpoint onto it.")
  flat = jax.tree_util.tree_flatten_with_path(node.value)[0]
  for (path, leaf), axis in zip(flat, node.axes):
    if axis is not None and jnp.shape(leaf)[axis] % n:
      raise StrategyMismatchError(
          f"Sharded leaf {jax.tree_util.keystr(path) or '<value>'} of shape "
          f"{jnp.shape(leaf)} cannot be split over this strategy's {n} "
          f"replicas along axis {axis}: it was laid out for another number of "
          "replicas. Initialise the optimizer state with this strategy, or "
          "restore it from a checkpoint onto it.")


MIRRORED = _Mirrored()
STATIC = _Static()
PER_REPLICA = _PerReplica()
SYNC_ON_READ = _SyncOnRead()
SHARDED = _Sharded()
BATCH_GROUP = _BatchGroup()

_BY_TYPE: dict = {}


def register(cls: type, kind: ValueKind) -> None:
  """Makes `kind` the kind of every value of type `cls` (exactly that type)."""
  _BY_TYPE[cls] = kind


register(PerReplica, PER_REPLICA)
register(SyncOnRead, SYNC_ON_READ)
register(Sharded, SHARDED)
register(BatchGroup, BATCH_GROUP)


def is_node(x: Any) -> bool:
  """Whether `x` has a kind of its own (flattening stops at it)."""
  return type(x) in _BY_TYPE


def is_kept_in_step(x: Any) -> bool:
  """Whether `x` is a value kept whole through a step (an output node)."""
  kind = _BY_TYPE.get(type(x))
  return kind is not None and kind.kept_in_step


def is_named_as_payload(x: Any) -> bool:
  """Whether a checkpoint names `x`'s leaves as its payload's."""
  kind = _BY_TYPE.get(type(x))
  return kind is not None and kind.named_as_payload


def has_layouts(x: Any) -> bool:
  """Whether `x` carries its own layout over the mesh (`ValueKind.layouts`)."""
  kind = _BY_TYPE.get(type(x))
  return kind is not None and kind.layouts(x) is not None


def kind_of(x: Any) -> ValueKind:
  """The kind of `x` outside a step: its type's, else `MIRRORED`."""
  return _BY_TYPE.get(type(x), MIRRORED)


def input_kind(x: Any) -> ValueKind:
  """The kind of a step's argument leaf `x`, traced under jit."""
  kind = _BY_TYPE.get(type(x))
  if kind is not None:
    return kind
  return MIRRORED if isinstance(x, jax.core.Tracer) else STATIC


def output_kind(x: Any, axis: str) -> ValueKind:
  """The kind of a step's output leaf `x`, traced inside the map: a value
  kept whole by its type's, an array `PER_REPLICA` if it varies over the
  replicas, else `MIRRORED`."""
  kind = _BY_TYPE.get(type(x))
  if kind is not None and kind.kept_in_step:
    return kind
  return PER_REPLICA if PER_REPLICA.is_output(x, axis) else MIRRORED


def registered_types() -> tuple:
  """The types that have a kind of their own."""
  return tuple(_BY_TYPE)
