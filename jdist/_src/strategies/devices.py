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
  """The device among `candidates` that `spec` names: a jax Device, an
  index, or a string ("cpu:1", or TensorFlow's full name) whose number is
  the position among that platform's candidates."""
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
  """Resolves device specs in order; None: every candidate, `replica_order`."""
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
  """`devices` (of one platform) in replica order: on TPU and GPU the
  interconnect's ring, as `jax.make_mesh` orders them; else by (process, id).
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
  """`(devices, axis_name)` of strategy `what` built on the one-axis `mesh`;
  a ValueError for `devices` given too, another `axis_name`, or more axes.
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
