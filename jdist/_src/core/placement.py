"""Moving host data onto a strategy's mesh, in one process or in many (each
process supplies the rows of its own replicas)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jdist._src import jax_compat
from jdist._src.core.values import is_distributed


def replicated_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


@functools.lru_cache(maxsize=256)
def per_replica_sharding(mesh, axis_name: str, inner_axis: str | None = None,
                         batch_axis: int = 1) -> NamedSharding:
  """Rows split over `axis_name`; each row's batch (its axis `batch_axis`)
  over `inner_axis`. Cached: a new `NamedSharding` per batch costs more than
  placing a small batch."""
  if inner_axis is None:
    return NamedSharding(mesh, P(axis_name))
  return NamedSharding(mesh, P(axis_name, *[None] * (batch_axis - 1),
                               inner_axis))


def spans_processes(mesh) -> bool:
  """Whether `mesh` has devices of more than one process."""
  # Asked for every batch: a mesh's devices never change, so remember it.
  known = _spans.get(mesh)
  if known is None:
    known = _spans[mesh] = len({d.process_index for d in mesh.devices.flat}) > 1
  return known


_spans: dict = {}  # mesh -> whether it spans processes


def put_replicated(x: Any, mesh) -> jax.Array:
  """Places one leaf whole on every device of `mesh`."""
  return put_laid_out(x, replicated_sharding(mesh))


def put_laid_out(x: Any, sharding: NamedSharding) -> jax.Array:
  """Places one leaf (every process holds it whole) in `sharding`."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if not spans_processes(sharding.mesh):
    return jax.device_put(x, sharding)
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    # Typed keys have no host form: place their data, then re-wrap it.
    data = put_laid_out(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def put_per_replica(local_rows: Any, mesh, axis_name: str,
                    num_replicas: int, inner_axis: str | None = None,
                    batch_axis: int = 1) -> Any:
  """Places this process's rows `(local_replicas, ...)` (a pytree, in one
  transfer) as `(R, ...)` arrays."""
  sharding = per_replica_sharding(mesh, axis_name, inner_axis, batch_axis)
  if not spans_processes(mesh):
    leaves, treedef = jax.tree.flatten(local_rows)
    return jax.tree.unflatten(treedef,
                              jax_compat.put_host_arrays(leaves, sharding))
  def one(rows):
    rows = np.asarray(rows)
    return jax.make_array_from_process_local_data(
        sharding, rows, (num_replicas,) + rows.shape[1:])
  return jax.tree.map(one, local_rows)


class StatePlacement:
  """Where a strategy holds its state between steps, and how it is read and
  written; this default mirrors state on the mesh.

  Example:
    >>> import jdist, numpy as np
    >>> strategy = jdist.MirroredStrategy()
    >>> placement = strategy.state_placement
    >>> held = strategy.replicate({"w": np.zeros(2, np.float32)})
    >>> held = placement.write(held, {"w": np.ones(2, np.float32)},
    ...                        strategy.mesh)
    >>> placement.read(held)["w"].tolist(), placement.abstract(held)["w"].shape
    ([1.0, 1.0], (2,))
  """

  moves = False

  def put(self, x: Any, mesh) -> jax.Array:
    """Places one mirrored leaf (`Strategy.replicate`)."""
    return put_replicated(x, mesh)

  def to_compute(self, args: tuple, kwargs: dict, mesh) -> tuple:
    """A step's `(args, kwargs)`, with the held state moved onto `mesh`."""
    del mesh
    return args, kwargs

  def to_storage(self, outputs: Any, mesh) -> Any:
    """A step's outputs, with mirrored leaves moved back where state is held."""
    del mesh
    return outputs

  def read(self, held: Any) -> Any:
    """The value of held state, as arrays the caller may read or keep."""
    return held

  def write(self, held: Any, value: Any, mesh) -> Any:
    """Writes `value` (same structure as `held`) into held state and returns
    the held state to use from now on; only host leaves are placed."""
    del held
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.Array) or is_distributed(x)
        else self.put(x, mesh), value, is_leaf=is_distributed)

  def abstract(self, held: Any) -> Any:
    """Held state's structure with `jax.ShapeDtypeStruct` leaves."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), held)


MESH_PLACEMENT = StatePlacement()


def local_replica_ids(mesh, axis_name: str) -> tuple:
  """Positions along `axis_name` of the replicas with a device in this process.

  A replica spanning processes counts for each of them: each feeds its rows.
  """
  me = jax.process_index()
  return tuple(i for i, replica in enumerate(replica_groups(mesh, axis_name))
               if any(d.process_index == me for d in replica))


def replica_groups(mesh, axis_name: str) -> np.ndarray:
  """The devices of each replica: `(replicas, devices per replica)`, in
  replica order along `axis_name`, each row in the mesh's order."""
  grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), 0)
  return grid.reshape(len(grid), -1)


def host_local(x: Any) -> Any:
  """This process's copy of a replicated array (which `np.asarray` refuses
  when the array spans processes); other values as they are."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x


def copy_arrays(tree: Any) -> Any:
  """A pytree with its device arrays copied (same placement; local ones in
  one dispatch): what a caller keeps when a step donates the originals."""
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
  arrays = [leaves[i] for i in at]
  if all(not isinstance(a, jax.core.Tracer) and a.is_fully_addressable and
         not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
         for a in arrays):
    copies = jax.device_put(arrays, may_alias=False)
  else:
    copies = [a.copy() for a in arrays]
  for i, c in zip(at, copies):
    leaves[i] = c
  return jax.tree.unflatten(treedef, leaves)


def to_host(tree: Any) -> Any:
  """A pytree of replicated arrays as numpy arrays (keys as key data)."""
  def leaf(x):
    x = host_local(x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(leaf, tree)


def local_shards(x: jax.Array) -> dict:
  """Maps replica position -> this process's shard (without the replica axis)."""
  out = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    out[start] = shard.data[0]
  return out
