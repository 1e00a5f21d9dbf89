"""Single-host strategies: MirroredStrategy, OneDeviceStrategy, `@jdist.mirrored`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh

from jdist._src.strategies import cross_device_ops as cross_device_ops_lib
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.spmd import Strategy
from jdist._src.strategies.devices import (from_mesh, resolve_device,
                                           resolve_devices)


class MirroredStrategy(Strategy):
  """Synchronous data parallelism over this process's devices.

  Args:
    devices: one replica each: jax Devices, indices or strings ("cpu:0",
      "/gpu:1"); default: every local device, in ring order.
    axis_name: name of the replica mesh axis (default "replica").
    mesh: instead of `devices`, a `jax.sharding.Mesh` or `jdist.DeviceMesh`
      of one axis.
    cross_device_ops: a `jdist.CrossDeviceOps` (XLA's all-reduce runs).

  Example:
    >>> import jax, jdist
    >>> strategy = jdist.MirroredStrategy()
    >>> strategy.num_replicas_in_sync == len(jax.local_devices())
    True
  """

  def __init__(self, devices: Sequence[Any] | None = None, *,
               axis_name: str | None = None, cross_device_ops=None,
               mesh: Mesh | DeviceMesh | None = None):
    self._cross_device_ops = cross_device_ops_lib.from_argument(
        cross_device_ops)
    if mesh is not None:
      devices, axis_name = from_mesh(mesh, "MirroredStrategy",
                                     devices=devices, axis_name=axis_name)
    super().__init__(resolve_devices(devices, jax.local_devices()),
                     axis_name=axis_name or "replica")

  @property
  def cross_device_ops(self):
    """The `cross_device_ops` given (None: the default); XLA all-reduces."""
    return self._cross_device_ops


class OneDeviceStrategy(Strategy):
  """Runs steps on one device, with the same API and semantics.

  Args:
    device: a jax Device, index or "cpu:0" (default: the first local one).
    axis_name: name of the replica mesh axis (default "replica").
    mesh: instead of `device`, a mesh of one device.

  Example:
    >>> import jdist
    >>> jdist.OneDeviceStrategy("cpu:0").num_replicas_in_sync
    1
  """

  def __init__(self, device: Any = None, *, axis_name: str | None = None,
               mesh: Mesh | DeviceMesh | None = None):
    candidates = jax.local_devices()
    if mesh is not None:
      devices, axis_name = from_mesh(mesh, "OneDeviceStrategy",
                                     devices=device, axis_name=axis_name)
      if len(devices) != 1:
        raise ValueError(
            f"OneDeviceStrategy got a mesh of {len(devices)} devices; give "
            "it a mesh of one (or use MirroredStrategy(mesh=mesh)).")
      device = devices[0]
    dev = candidates[0] if device is None else resolve_device(device, candidates)
    super().__init__((dev,), axis_name=axis_name or "replica")


def mirrored(fn: Callable | None = None, *, devices=None, **options):
  """Decorator: runs `fn` as a per-replica step with a `MirroredStrategy`
  over `devices`; other arguments are `Strategy.function`'s.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> @jdist.mirrored
    ... def step(x):
    ...   return x + 1
    >>> step(jnp.zeros(2))
    Array([1., 1.], dtype=float32)
  """
  if fn is None:
    return functools.partial(mirrored, devices=devices, **options)
  return _LazyMirrored(fn, devices, options)


class _LazyMirrored:

  def __init__(self, fn, devices, options):
    self._fn = fn
    self._devices = devices
    self._options = options
    self._step = None
    functools.update_wrapper(self, fn)

  @property
  def strategy(self) -> MirroredStrategy:
    return self._compiled().strategy

  @property
  def python_function(self) -> Callable:
    return self._fn

  def _compiled(self):
    if self._step is None:
      self._step = MirroredStrategy(self._devices).function(
          self._fn, **self._options)
    return self._step

  def __call__(self, *args, **kwargs):
    return self._compiled()(*args, **kwargs)
