"""`DeviceMesh`: devices arranged on named axes, as Keras 3's `DeviceMesh`."""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jdist._src.runtime import runtime as runtime_lib


def default_devices(shape: tuple) -> np.ndarray:
  """Every device of the run, laid out on `shape` by the hybrid mesh rule,
  or in `jax.devices()` order when they do not fit it."""
  runtime_lib.initialize()  # a process of a run sees every device only after
  processes = jax.process_count()
  devices = jax.devices()
  if (processes == 1 or shape[0] % processes
      or math.prod(shape) != len(devices)):
    return np.array(devices, dtype=object)
  per_process = (shape[0] // processes,) + tuple(shape[1:])
  across = (processes,) + (1,) * (len(shape) - 1)
  return mesh_utils.create_hybrid_device_mesh(
      per_process, across, devices, process_is_granule=True)


def _sizes(shape: tuple, axis_names: tuple) -> tuple:
  """`shape` as Python ints, each checked to be a positive integer."""
  for size, name in zip(shape, axis_names):
    if (isinstance(size, bool) or not isinstance(size, numbers.Integral)
        or size < 1):
      raise ValueError(
          f"DeviceMesh shape {shape}: axis {name!r} has size {size!r}, which "
          "is not a positive integer. Each size is the number of devices "
          "along its axis (an int of at least 1), and the sizes multiply to "
          "the number of devices, for example (2, 2) for 4.")
  return tuple(int(size) for size in shape)


def _check_unique(devices: list) -> None:
  """Raises unless every device appears once."""
  first = {}
  for i, device in enumerate(devices):
    if device in first:
      raise ValueError(
          f"DeviceMesh devices list {device} twice (at positions "
          f"{first[device]} and {i}, flattened): a device takes one place "
          "of the mesh. Pass each device once, for example "
          "jax.devices()[:n] for a mesh of n devices.")
    first[device] = i


def _count_problem(shape: tuple, count: int, found: bool) -> str:
  """Why `count` devices (the run's, when `found`) cannot fill `shape`."""
  if not found:
    return (f"DeviceMesh shape {shape} holds {math.prod(shape)} devices but "
            f"{count} were given. Choose a shape whose sizes multiply to "
            f"{count}, or pass that many devices.")
  processes, local = jax.process_count(), jax.local_device_count()
  each = (f" ({processes} process{'es' if processes > 1 else ''} x {local} "
          "devices)" if processes * local == count else "")
  return (
      f"DeviceMesh shape {shape} holds {math.prod(shape)} devices but this "
      f"run has {count}{each}. Choose a shape whose sizes multiply to "
      f"{count}, for example from jax.device_count(): a job that `jdist "
      "launch` restarted on fewer processes has fewer devices (a checkpoint "
      "restores onto another mesh; a pipeline's stacked layers onto another "
      "number of stages that divides them).")


def repeated_axis(spec) -> tuple[str, int, int] | None:
  """`(axis, first dimension, second dimension)` of the first mesh axis that
  the layout `spec` names for two dimensions (JAX refuses it), or None."""
  seen = {}
  for dim, axes in enumerate(spec):
    for axis in axes if isinstance(axes, tuple) else (axes,):
      if axis is None:
        continue
      if axis in seen:
        return axis, seen[axis], dim
      seen[axis] = dim
  return None


class DeviceMesh:
  """Devices laid out on a grid whose axes have names.

  As Keras 3's `keras.distribution.DeviceMesh`: one axis splits the batch
  over replicas, the others split each replica's parameters.

  Args:
    shape: the size of each axis; their product is the number of devices.
    axis_names: one name per axis.
    devices: the devices, in row-major order over `shape`. Default: every
      device of every process (joining the run), the first axis split over
      the processes (docs/model_parallelism.md).

  Raises:
    ValueError: shape and names disagree, or the devices do not fill it.

  Example:
    >>> import jax, jdist
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> mesh.axis_names, mesh.shape[0]
    (('data', 'model'), 1)
  """

  def __init__(self, shape: Sequence[int], axis_names: Sequence[str],
               devices: Sequence[Any] | None = None):
    shape, axis_names = tuple(shape), tuple(axis_names)
    if len(shape) != len(axis_names):
      raise ValueError(
          f"DeviceMesh shape {shape} has {len(shape)} axes but axis_names "
          f"{axis_names} has {len(axis_names)}: give one name per axis.")
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f"DeviceMesh axis_names {axis_names} repeat a name.")
    shape = _sizes(shape, axis_names)
    found = devices is None
    devices = list(np.asarray(default_devices(shape) if found
                              else devices, dtype=object).ravel())
    _check_unique(devices)
    if math.prod(shape) != len(devices):
      raise ValueError(_count_problem(shape, len(devices), found))
    self._shape = shape
    self._axis_names = axis_names
    self._devices = np.array(devices, dtype=object).reshape(shape)

  @classmethod
  def from_jax(cls, mesh: Mesh) -> "DeviceMesh":
    """The `DeviceMesh` of a `jax.sharding.Mesh` (Auto or Explicit axes).

    Raises:
      TypeError: `mesh` is not a `jax.sharding.Mesh`.

    Example:
      >>> import jax, jdist
      >>> mesh = jax.make_mesh((1, len(jax.devices())), ("data", "model"))
      >>> jdist.DeviceMesh.from_jax(mesh).axis_names
      ('data', 'model')
    """
    if not isinstance(mesh, Mesh):
      raise TypeError(
          "DeviceMesh.from_jax needs a jax.sharding.Mesh (jax.make_mesh's), "
          f"got {type(mesh).__name__}.")
    return cls(mesh.devices.shape, mesh.axis_names, list(mesh.devices.flat))

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

  def split_problem(self, path: str, shape: Sequence[int], spec,
                    remedy: str) -> str | None:
    """Why `spec` cannot split the array of `shape` at `path` on this mesh,
    or None; `remedy` ends the message."""
    shape = tuple(shape)
    repeated = repeated_axis(spec)
    if repeated is not None:
      axis, first, second = repeated
      return (
          f"Parameter {path!r} of shape {shape}: its layout {tuple(spec)} "
          f"names mesh axis {axis!r} for dimensions {first} and {second}, "
          "but an axis can split one dimension only. Give the other "
          f"dimension another axis, {remedy}")
    for dim, (size, axes) in enumerate(zip(shape, spec)):
      axes = axes if isinstance(axes, tuple) else (axes,)
      split = int(np.prod([self.axis_size(a) for a in axes if a]))
      if size % split:
        return (
            f"Parameter {path!r} of shape {shape}: dimension {dim} "
            f"({size}) cannot be split over mesh axis "
            f"{'x'.join(map(str, axes))} of size {split}. Choose an axis "
            f"whose size divides {size}, {remedy}")
    return None

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


def as_device_mesh(mesh: Any, what: str) -> DeviceMesh:
  """`mesh` as a `DeviceMesh`; a TypeError naming `what` if it is none."""
  if isinstance(mesh, DeviceMesh):
    return mesh
  if isinstance(mesh, Mesh):
    return DeviceMesh.from_jax(mesh)
  raise TypeError(
      f"{what} must be a jdist.DeviceMesh or a jax.sharding.Mesh "
      f"(jax.make_mesh's), got {type(mesh).__name__}.")
