"""ModelParallelStrategy: replicas that span devices, laid out by a LayoutMap."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.core import kinds, placement
from jdist._src.strategies.layout_map import LayoutMap, path_name
from jdist._src.strategies.spmd import Strategy


def _uses(spec: P, axis: str) -> bool:
  return any(axis == a or (isinstance(a, tuple) and axis in a) for a in spec)


def fsdp_spec(spec: P, shape: tuple, axis: str, size: int) -> P:
  """`spec` with its largest free dimension that `size` divides split over
  the FSDP `axis` (ZeRO-3); unchanged when it already uses `axis` or no
  dimension fits (scalars, small vectors: kept whole on each device)."""
  if _uses(spec, axis):
    return spec
  dims = list(spec) + [None] * (len(shape) - len(spec))
  free = [d for d in range(len(shape))
          if dims[d] is None and shape[d] % size == 0]
  if not free:
    return spec
  dims[max(free, key=lambda d: (shape[d], -d))] = axis
  return P(*dims)


class ModelParallelStrategy(Strategy):
  """Data parallelism over one mesh axis, the parameters split over the others.

  As Keras 3's `keras.distribution.ModelParallel`: the mesh axis
  `batch_dim_name` splits the global batch over replicas; each replica is
  the group of devices along the other axes, over which the parameters are
  split as `layout_map` says (XLA partitions the replica's computation from
  those layouts). The per-replica step, `compute_average_loss`, metrics and
  `num_replicas_in_sync` (the size of the batch axis) mean what they mean
  for `MirroredStrategy`; gradients are summed over the replicas.

  FSDP (ZeRO-3) is one argument: `fsdp_axis` names a within-replica axis
  that splits both each replica's batch and every parameter (its largest
  dimension that the axis divides, unless the LayoutMap already uses that
  axis for it), so that each device holds 1/k of the parameters, gradients
  and optimizer state; XLA gathers them for the computation.

  Args:
    layout_map: a `jdist.LayoutMap` over a `jdist.DeviceMesh`.
    batch_dim_name: the mesh axis of the replicas; defaults to the mesh's
      first axis (as Keras).
    fsdp_axis: a mesh axis (not the batch one) for FSDP, or None.

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> n = len(jax.devices())
    >>> mesh = jdist.DeviceMesh((n, 1), ("data", "model"))
    >>> layout_map = jdist.LayoutMap(mesh)
    >>> layout_map["w"] = (None, "model")
    >>> strategy = jdist.ModelParallelStrategy(layout_map=layout_map,
    ...                                        batch_dim_name="data")
    >>> params = strategy.init(lambda: {"w": jnp.ones((2, 4))})
    >>> params["w"].sharding.spec
    P(None, 'model')
  """

  def __init__(self, *, layout_map: LayoutMap,
               batch_dim_name: str | None = None,
               fsdp_axis: str | None = None):
    if not isinstance(layout_map, LayoutMap):
      raise TypeError(
          "ModelParallelStrategy needs layout_map=jdist.LayoutMap(mesh), got "
          f"{type(layout_map).__name__}.")
    device_mesh = layout_map.device_mesh
    batch_dim_name = batch_dim_name or device_mesh.axis_names[0]
    device_mesh.check_axis(batch_dim_name, "batch_dim_name")
    if fsdp_axis is not None:
      device_mesh.check_axis(fsdp_axis, "fsdp_axis")
      if fsdp_axis == batch_dim_name:
        raise ValueError(
            f"fsdp_axis and batch_dim_name are both {fsdp_axis!r}: FSDP splits "
            "each replica over another mesh axis. Give the mesh a second "
            "axis, for example DeviceMesh((2, 2), ('data', 'fsdp')).")
    self._fsdp_axis = fsdp_axis
    mesh = device_mesh.jax_mesh
    self._layout_map = layout_map
    first_devices = placement.replica_groups(mesh, batch_dim_name)[:, 0]
    super().__init__(tuple(first_devices), axis_name=batch_dim_name,
                     mesh=mesh)

  @property
  def layout_map(self) -> LayoutMap:
    """The rules that lay the parameters out."""
    return self._layout_map

  @property
  def device_mesh(self):
    """The `jdist.DeviceMesh` (Keras's name for the mesh)."""
    return self._layout_map.device_mesh

  @property
  def fsdp_axis(self) -> str | None:
    """The mesh axis that splits the parameters and each replica's batch."""
    return self._fsdp_axis

  @property
  def replica_batch_axis(self) -> str | None:
    return self._fsdp_axis

  @property
  def identity(self) -> tuple:
    return super().identity + (self.device_mesh, self._fsdp_axis)

  def __repr__(self) -> str:
    fsdp = f", fsdp_axis={self._fsdp_axis!r}" if self._fsdp_axis else ""
    return (f"ModelParallelStrategy({self.device_mesh!r}, "
            f"batch_dim_name={self.axis_name!r}{fsdp})")

  def partition_specs(self, tree: Any) -> Any:
    """The `PartitionSpec` of every leaf of `tree`: the layout map's, split
    over `fsdp_axis` as well when there is one."""
    specs = self._layout_map.partition_specs(tree)
    return jax.tree.map(self._with_fsdp, specs, tree,
                        is_leaf=lambda x: isinstance(x, P))

  def shardings(self, tree: Any) -> Any:
    """The `NamedSharding` of every leaf of `tree` (see `partition_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                        self.partition_specs(tree),
                        is_leaf=lambda x: isinstance(x, P))

  def _with_fsdp(self, spec: P, leaf: Any) -> P:
    if self._fsdp_axis is None:
      return spec
    size = self.device_mesh.axis_size(self._fsdp_axis)
    return fsdp_spec(spec, np.shape(leaf), self._fsdp_axis, size)

  def keep_layouts(self, outputs: Any) -> Any:
    """Inside a traced step: its outputs held in the layouts `init` gives.

    Without it XLA chooses the layout of a returned array: a bias no rule
    splits came back split like the kernel it is added to, so the next call
    (its argument laid out anew) compiled the step a second time. Keys match
    a path's tail (`LayoutMap.layout_of`), so `return params, opt_state,
    loss` finds each array's rule under its position. A distributed value
    (`PerReplica`, ...) keeps its own layout; an array its rule cannot lay
    out (another rank, an indivisible dimension) is not state the map
    describes and is left as XLA places it.
    """
    layout_map = self._layout_map

    def one(path, node):
      if kinds.is_node(node) or not isinstance(node, jax.Array):
        return node
      name, shape = path_name(path), np.shape(node)
      if layout_map.problem(name, shape) is not None:
        return node
      spec = self._with_fsdp(layout_map.spec_for(name, shape), node)
      return jax.lax.with_sharding_constraint(
          node, NamedSharding(self.mesh, spec))
    return jax.tree_util.tree_map_with_path(one, outputs, is_leaf=kinds.is_node)

  def init(self, fn: Callable, *args, **kwargs) -> Any:
    """Runs `fn(*args, **kwargs)` compiled so that its result is created laid
    out: each leaf directly in its layout, never whole on one device.

    Use it for the parameters and the optimizer state
    (`strategy.init(optimizer.init, params)`): a LayoutMap key that matches
    a parameter's path also matches the optimizer state's copies of it (a
    path's tail after a "/", `0/trace/dense/kernel`), so the momentum is
    split as its parameter is.
    """
    shapes = jax.eval_shape(fn, *args, **kwargs)
    return jax.jit(fn, out_shardings=self.shardings(shapes))(*args, **kwargs)
