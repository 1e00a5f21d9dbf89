"""ModelParallelStrategy: replicas that span devices, laid out by a LayoutMap."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from jdist._src.strategies.layout_map import LayoutMap
from jdist._src.strategies.spmd import Strategy


def _replica_devices(mesh, batch_dim_name: str) -> tuple:
  """One device per replica (its first), in replica order."""
  axis = mesh.axis_names.index(batch_dim_name)
  grid = np.moveaxis(mesh.devices, axis, 0)
  return tuple(grid.reshape(grid.shape[0], -1)[:, 0])


class ModelParallelStrategy(Strategy):
  """Data parallelism over one mesh axis, the parameters split over the others.

  As Keras 3's `keras.distribution.ModelParallel`: the mesh axis
  `batch_dim_name` splits the global batch over replicas; each replica is
  the group of devices along the other axes, over which the parameters are
  split as `layout_map` says (XLA partitions the replica's computation from
  those layouts). The per-replica step, `compute_average_loss`, metrics and
  `num_replicas_in_sync` (the size of the batch axis) mean what they mean
  for `MirroredStrategy`; gradients are summed over the replicas.

  Args:
    layout_map: a `jdist.LayoutMap` over a `jdist.DeviceMesh`.
    batch_dim_name: the mesh axis of the replicas; defaults to the mesh's
      first axis (as Keras).

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> layout_map = jdist.LayoutMap(mesh)
    >>> layout_map["w"] = (None, "model")
    >>> strategy = jdist.ModelParallelStrategy(layout_map=layout_map,
    ...                                        batch_dim_name="data")
    >>> params = strategy.init(lambda: {"w": jnp.ones((2, 4 * mesh.shape[1]))})
    >>> params["w"].sharding.spec
    P(None, 'model')
  """

  def __init__(self, *, layout_map: LayoutMap,
               batch_dim_name: str | None = None):
    if not isinstance(layout_map, LayoutMap):
      raise TypeError(
          "ModelParallelStrategy needs layout_map=jdist.LayoutMap(mesh), got "
          f"{type(layout_map).__name__}.")
    device_mesh = layout_map.device_mesh
    batch_dim_name = batch_dim_name or device_mesh.axis_names[0]
    device_mesh.check_axis(batch_dim_name, "batch_dim_name")
    mesh = device_mesh.jax_mesh
    self._layout_map = layout_map
    super().__init__(_replica_devices(mesh, batch_dim_name),
                     axis_name=batch_dim_name, mesh=mesh)

  @property
  def layout_map(self) -> LayoutMap:
    """The rules that lay the parameters out."""
    return self._layout_map

  @property
  def device_mesh(self):
    """The `jdist.DeviceMesh` (Keras's name for the mesh)."""
    return self._layout_map.device_mesh

  @property
  def identity(self) -> tuple:
    return super().identity + (self.device_mesh,)

  def shardings(self, tree: Any) -> Any:
    """The `NamedSharding` of every leaf of `tree`, by the layout map."""
    return self._layout_map.shardings(tree)

  def init(self, fn: Callable, *args, **kwargs) -> Any:
    """Runs `fn(*args, **kwargs)` compiled so that its result is created laid
    out: each leaf directly in its layout, never whole on one device.

    Use it for the parameters and the optimizer state
    (`strategy.init(optimizer.init, params)`): a LayoutMap key matches the
    optimizer state's paths as it matches the parameters' (write `.*kernel`
    rather than `dense/kernel` to lay out both).
    """
    shapes = jax.eval_shape(fn, *args, **kwargs)
    return jax.jit(fn, out_shardings=self.shardings(shapes))(*args, **kwargs)
