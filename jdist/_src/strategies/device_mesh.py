"""`DeviceMesh`: devices arranged on named axes, as Keras 3's `DeviceMesh`."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


class DeviceMesh:
  """Devices laid out on a grid whose axes have names.

  The names mean what Keras 3's `keras.distribution.DeviceMesh` means: one
  axis splits the global batch over replicas (the data axis), the others
  split each replica's parameters (and, for FSDP, its batch) over devices.

  Args:
    shape: the size of each axis; their product is the number of devices.
    axis_names: one name per axis.
    devices: the devices, in row-major order over `shape`: jax Devices.
      Defaults to every device (`jax.devices()`).

  Raises:
    ValueError: the shape and the names differ in length, a name repeats,
      or the mesh's size is not the number of devices.

  Example:
    >>> import jax, jdist
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> mesh.axis_names, mesh.shape[0]
    (('data', 'model'), 1)
  """

  def __init__(self, shape: Sequence[int], axis_names: Sequence[str],
               devices: Sequence[Any] | None = None):
    shape = tuple(int(s) for s in shape)
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
      raise ValueError(
          f"DeviceMesh shape {shape} has {len(shape)} axes but axis_names "
          f"{axis_names} has {len(axis_names)}: give one name per axis.")
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f"DeviceMesh axis_names {axis_names} repeat a name.")
    devices = list(jax.devices() if devices is None
                   else np.asarray(devices, dtype=object).ravel())
    if math.prod(shape) != len(devices):
      raise ValueError(
          f"DeviceMesh shape {shape} holds {math.prod(shape)} devices but "
          f"{len(devices)} were given (or found). Choose a shape whose sizes "
          f"multiply to {len(devices)}, or pass that many devices.")
    self._shape = shape
    self._axis_names = axis_names
    self._devices = np.array(devices, dtype=object).reshape(shape)

  @property
  def shape(self) -> tuple:
    """The size of each axis."""
    return self._shape

  @property
  def axis_names(self) -> tuple:
    """The name of each axis."""
    return self._axis_names

  @property
  def devices(self) -> np.ndarray:
    """The devices, as an array of `shape`."""
    return self._devices

  def axis_size(self, name: str) -> int:
    """The size of the axis `name`.

    Raises:
      ValueError: `name` is not an axis of this mesh.
    """
    self.check_axis(name, "an axis")
    return self._shape[self._axis_names.index(name)]

  def check_axis(self, name: Any, what: str) -> None:
    """Raises a ValueError naming `what` unless `name` is an axis here."""
    if name not in self._axis_names:
      raise ValueError(
          f"{what} names the mesh axis {name!r}, but the mesh's axes are "
          f"{self._axis_names}. Use one of those names (or None to replicate "
          "that dimension).")

  @property
  def jax_mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` (axes of type Auto: XLA partitions them)."""
    return Mesh(self._devices, self._axis_names,
                axis_types=(AxisType.Auto,) * len(self._shape))

  def __eq__(self, other) -> bool:
    return (isinstance(other, DeviceMesh) and self._shape == other.shape
            and self._axis_names == other.axis_names
            and [d.id for d in self._devices.flat]
            == [d.id for d in other.devices.flat])

  def __hash__(self) -> int:
    return hash((self._shape, self._axis_names,
                 tuple(d.id for d in self._devices.flat)))

  def __repr__(self) -> str:
    axes = ", ".join(f"{n}={s}" for n, s in zip(self._axis_names, self._shape))
    return f"DeviceMesh({axes})"
