"""CentralStorageStrategy: variables held once, on one device; compute mirrored.

The step runs as under `MirroredStrategy`; only where the state lives between
steps differs: `CentralPlacement`, the strategy's `StatePlacement`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import SingleDeviceSharding

from jdist._src.core import placement
from jdist._src.core.values import is_distributed
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.spmd import Strategy
from jdist._src.strategies.devices import (from_mesh, resolve_device,
                                           resolve_devices)


class CentralPlacement(placement.StatePlacement):
  """Mirrored values held once on `device`, moved to the mesh (and the new
  state back) in one transfer each way per step; per-replica values stay.
  """

  moves = True

  def __init__(self, device):
    self.device = device
    self.sharding = SingleDeviceSharding(device)

  def put(self, x: Any, mesh) -> jax.Array:
    del mesh
    if isinstance(x, jax.Array) and x.sharding == self.sharding:
      return x
    return jax.device_put(x, self.sharding)

  def _held(self, x) -> bool:
    return _concrete(x) and x.sharding == self.sharding

  def to_compute(self, args: tuple, kwargs: dict, mesh) -> tuple:
    return _move(self._held, placement.replicated_sharding(mesh),
                 (args, kwargs))

  def to_storage(self, outputs: Any, mesh) -> Any:
    mirrored = placement.replicated_sharding(mesh)
    return _move(lambda x: _concrete(x) and x.sharding == mirrored,
                 self.sharding, outputs)


def _concrete(x) -> bool:
  """An array with a placement (under an outer `jax.jit`, jit places values)."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _move(select, sharding, tree):
  """`tree` with the leaves `select` picks put on `sharding`, in one transfer."""
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_distributed)
  picked = [i for i, x in enumerate(leaves) if select(x)]
  if picked:
    moved = jax.device_put([leaves[i] for i in picked], sharding)
    for i, x in zip(picked, moved):
      leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _all_local_devices() -> tuple:
  """This process's devices of every platform (the CPU too next to GPUs)."""
  devices = list(jax.local_devices())
  try:
    devices += [d for d in jax.local_devices(backend="cpu") if d not in devices]
  except RuntimeError:  # no CPU backend in this build
    pass
  return tuple(devices)


class CentralStorageStrategy(Strategy):
  """Synchronous training with the variables held once, on one device.

  Steps run as under `MirroredStrategy`; between steps the state is held
  once, on the parameter device (two transfers of it per step).

  Args:
    compute_devices: the replicas' devices (default: every local device).
    parameter_device: the device that holds the variables (default: the
      compute device when there is only one, else the host CPU).
    axis_name: name of the replica mesh axis (default "replica").
    mesh: instead of `compute_devices`, a mesh of one axis.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.CentralStorageStrategy()
    >>> w = strategy.replicate(jnp.ones(3))
    >>> w.devices() == {strategy.parameter_device}
    True
  """

  # Keras on JAX cannot hold variables on one device and compute on others.
  keras_distribution = "unsupported"

  def __init__(self, compute_devices: Sequence[Any] | None = None,
               parameter_device: Any = None, *, axis_name: str | None = None,
               mesh: Mesh | DeviceMesh | None = None):
    if mesh is not None:
      compute_devices, axis_name = from_mesh(
          mesh, "CentralStorageStrategy", devices=compute_devices,
          axis_name=axis_name)
    axis_name = axis_name or "replica"
    devices = resolve_devices(compute_devices, jax.local_devices())
    if parameter_device is None:
      cpus = [d for d in _all_local_devices() if d.platform == "cpu"]
      parameter_device = (devices[0] if len(devices) == 1 or not cpus else
                          cpus[0])
    else:
      parameter_device = resolve_device(parameter_device, _all_local_devices())
    self._parameter_device = parameter_device
    # One compute device that also holds the variables: nothing to move.
    moves = devices != (parameter_device,)
    super().__init__(devices, axis_name=axis_name, state_placement=(
        CentralPlacement(parameter_device) if moves else None))

  @property
  def identity(self) -> tuple:
    d = self._parameter_device
    return super().identity + ((d.platform, d.id),)

  def __repr__(self) -> str:
    d = self._parameter_device
    return (f"{super().__repr__()[:-1]}, parameter_device={d.platform}:{d.id})")

  @property
  def parameter_device(self):
    """The device that holds the variables between steps."""
    return self._parameter_device
