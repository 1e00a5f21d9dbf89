"""Turning what a user writes for devices into a checked tuple of jax Devices."""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
from jax.experimental import mesh_utils

from jdist._src.strategies.device_mesh import as_device_mesh

# "cpu:1", "/gpu:0", "/device:TPU:3", and TensorFlow's full names such as
# "/job:localhost/replica:0/task:0/device:CPU:0".
_SPEC = re.compile(r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:(\d+))?"
                   r"/?(?:device:)?([a-zA-Z]+):(\d+)$")


def _describe(devices: Sequence[Any]) -> str:
  return ", ".join(f"{d.platform}:{d.id}" for d in devices)


def resolve_device(spec: Any, candidates: Sequence[Any]) -> Any:
  """Returns the device among `candidates` that `spec` names.

  `spec` is a jax Device, an index into `candidates`, or a string such as
  "cpu:1", "/gpu:0", "/device:TPU:3" or TensorFlow's full name
  "/job:localhost/replica:0/task:0/device:CPU:0" (its task must be this
  process). The number in a string is the position among the candidates of
  that platform, not the device id, which is not contiguous on
  multi-process runs.
  """
  if isinstance(spec, jax.Device):
    if spec not in candidates:
      raise ValueError(
          f"Device {spec} is not one of the devices this process can use "
          f"({_describe(candidates)}). Pick devices from jax.local_devices().")
    return spec
  if isinstance(spec, int) and not isinstance(spec, bool):
    if not 0 <= spec < len(candidates):
      raise ValueError(
          f"Device index {spec} is out of range: there are {len(candidates)} "
          f"devices ({_describe(candidates)}).")
    return candidates[spec]
  if isinstance(spec, str):
    m = _SPEC.match(spec.strip())
    if m:
      task, platform, index = m.group(1), m.group(2).lower(), int(m.group(3))
      if task is not None and int(task) != jax.process_index():
        raise ValueError(
            f"Device {spec!r} belongs to task {task}, but this is process "
            f"{jax.process_index()}: a strategy's devices here are this "
            "process's (the others join through MultiWorkerMirroredStrategy). "
            f"Name this process's devices, e.g. "
            f"'/job:localhost/replica:0/task:{jax.process_index()}/device:"
            f"{platform.upper()}:0'.")
      same = [d for d in candidates if d.platform == platform]
      if index < len(same):
        return same[index]
      raise ValueError(
          f"Unknown device {spec!r}: there are {len(same)} {platform} devices "
          f"here ({_describe(candidates)}). For more CPU devices, start Python "
          "with XLA_FLAGS=--xla_force_host_platform_device_count=N.")
  raise ValueError(
      f"Cannot understand the device {spec!r}. Pass a jax.Device, an index, or "
      "a string like 'cpu:0', '/gpu:1' or "
      "'/job:localhost/replica:0/task:0/device:CPU:0'.")


def resolve_devices(specs: Sequence[Any] | None,
                    candidates: Sequence[Any]) -> tuple:
  """Resolves a list of device specs, in the order given; None means every
  candidate, in `replica_order`."""
  if specs is None:
    return replica_order(candidates)
  if isinstance(specs, (str, jax.Device)):
    specs = [specs]
  resolved = tuple(resolve_device(s, candidates) for s in specs)
  if not resolved:
    raise ValueError("The device list is empty; pass at least one device.")
  seen = set()
  for spec, dev in zip(specs, resolved):
    if dev in seen:
      raise ValueError(
          f"Device {spec!r} ({dev.platform}:{dev.id}) appears twice in the device "
          "list; every replica needs a device of its own.")
    seen.add(dev)
  platforms = {d.platform for d in resolved}
  if len(platforms) > 1:
    raise ValueError(
        f"The devices mix platforms ({sorted(platforms)}); one strategy runs one "
        "compiled program, so use devices of one platform.")
  return resolved


def _process_order(devices: Sequence[Any]) -> tuple:
  return tuple(sorted(devices, key=lambda d: (d.process_index, d.id)))


def _ring_order(devices: Sequence[Any]) -> tuple:
  """One slice's devices in the order `jax.make_mesh((n,), ...)` gives them."""
  devices = _process_order(devices)  # the handlers expect jax.devices() order
  try:
    return tuple(mesh_utils.create_device_mesh((len(devices),), devices).flat)
  except (AssertionError, ValueError, NotImplementedError):
    # mesh_utils knows no layout for these devices (not a full cuboid of
    # chips, an unknown TPU kind): the order is a speed matter, not a
    # correctness one, so keep the process order.
    return devices


def replica_order(devices: Sequence[Any]) -> tuple:
  """The order of the replicas over `devices`: the physical topology's on
  TPU and GPU, each process's devices together on other platforms.

  The replica axis is a ring for the all-reduce, so on TPU and GPU the
  replicas follow `jax.experimental.mesh_utils.create_device_mesh` (what
  `jax.make_mesh` uses): TPU cores in the order of the chips' interconnect
  (a TPU v3-8 gives ids 0, 1, 2, 3, 6, 7, 4, 5), GPUs by XLA's global
  numbering. Several TPU slices (multislice, joined by the data-center
  network) come one after the other by `slice_index`, each in its ring order,
  as `mesh_utils.create_hybrid_device_mesh` lays out a 1-D mesh. Elsewhere
  (CPU), and where mesh_utils knows no layout, devices are ordered by
  (process, id): ids are not positions (a 2-process CPU run has ids 0, 1,
  2048, 2049).

  On a TPU pod the ring may alternate between hosts; a process then supplies
  the rows of replicas that are not contiguous (each process gathers its
  rows of the global batch, which costs a host copy), and results are the
  same as with any other order.

  Args:
    devices: jax Devices of one platform.

  Returns:
    The same devices, as a tuple in replica order.
  """
  devices = tuple(devices)
  if not devices or devices[0].platform not in ("tpu", "gpu"):
    return _process_order(devices)
  slices = {}
  for d in devices:
    slices.setdefault(getattr(d, "slice_index", 0) or 0, []).append(d)
  return tuple(d for key in sorted(slices) for d in _ring_order(slices[key]))


def from_mesh(mesh: Any, what: str, *, devices: Any = None,
              axis_name: str | None = None) -> tuple[tuple, str]:
  """The devices and the replica axis of a strategy built on `mesh`.

  Args:
    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes) or a
      `jdist.DeviceMesh`, of one axis: one replica per device.
    what: the strategy's name, for messages.
    devices: the strategy's `devices` argument: must be None.
    axis_name: the strategy's `axis_name` argument: None or the mesh's.

  Returns:
    `(devices, axis_name)`: the mesh's devices in their order, its axis.

  Raises:
    ValueError: devices given too, an axis name that is not the mesh's, or a
      mesh of several axes.
  """
  if devices is not None:
    raise ValueError(f"{what} got both devices and mesh: give one of them.")
  device_mesh = as_device_mesh(mesh, f"{what}'s mesh")
  names = device_mesh.axis_names
  if len(names) != 1:
    raise ValueError(
        f"{what} runs one replica per device over one mesh axis, but the mesh "
        f"has the axes {names} (shape {device_mesh.shape}). For replicas "
        "that span the other axes (parameters split over them) use "
        "jdist.ModelParallelStrategy(device_mesh=mesh, batch_dim_name=...); "
        "for data parallelism over every device give a mesh of one axis.")
  if axis_name is not None and axis_name != names[0]:
    raise ValueError(
        f"{what} got axis_name={axis_name!r} and a mesh whose axis is "
        f"{names[0]!r}: the replica axis is the mesh's; leave axis_name out.")
  return tuple(device_mesh.devices.flat), names[0]
