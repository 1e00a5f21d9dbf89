"""Other layouts of the same step on the same devices, to say what fits:
each compiled and planned, least sharded first, until one fits. They keep
every mesh axis that lays the model out and spread the other devices
between data parallelism and FSDP."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

from jdist._src.planning.report import Alternative
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.layout_map import LayoutMap
from jdist._src.strategies.model_parallel import ModelParallelStrategy


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A layout to plan: its name, the code that asks for it, its strategy
  (None: the step's), and what else planning it needs."""

  name: str
  how: str
  strategy: Any = None
  extra: Any = None


def fsdp_candidates(strategy) -> list[Candidate]:
  """FSDP over more of `strategy`'s devices, least first (none for one)."""
  mesh = strategy.mesh
  names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
  batch = strategy.axis_name
  current = getattr(strategy, "fsdp_axis", None)
  kept = [(n, s) for n, s in zip(names, sizes) if n not in (batch, current)]
  fsdp = current or _free_name("fsdp", names)
  rest = mesh.devices.size // math.prod(s for _, s in kept)
  now = dict(zip(names, sizes)).get(current, 1)
  devices = list(mesh.devices.flat)
  out = []
  for f in (f for f in range(now + 1, rest + 1) if rest % f == 0):
    shape = (rest // f, f) + tuple(s for _, s in kept)
    axes = (batch, fsdp) + tuple(n for n, _ in kept)
    device_mesh = DeviceMesh(shape, axes, devices)
    layout_map = _moved(getattr(strategy, "layout_map", None), device_mesh)
    rules = getattr(strategy, "logical_axis_rules", ())
    candidate = ModelParallelStrategy(
        layout_map=layout_map, device_mesh=device_mesh, batch_dim_name=batch,
        fsdp_axis=fsdp, logical_axis_rules=rules)
    model = "".join(f", {n!r} {s} kept" for n, s in kept)
    how = (f"jdist.ModelParallelStrategy(device_mesh=jdist.DeviceMesh("
           f"{shape}, {axes}), batch_dim_name={batch!r}, fsdp_axis={fsdp!r}"
           + (", layout_map=<the same rules on that mesh>" if layout_map
              is not None else "") + ")")
    out.append(Candidate(
        f"FSDP over {fsdp!r} ({f} devices, {rest // f} replica(s){model})",
        how, candidate))
  return out


def evaluate(candidates: Iterable[Candidate],
             plan_of: Callable[[Candidate], Any]) -> tuple:
  """Plans each candidate until one fits; the `Alternative`s planned."""
  out = []
  for c in candidates:
    try:
      planned = plan_of(c)
    except Exception as e:  # noqa: BLE001  (a candidate, not the user's run)
      out.append(Alternative(c.name, c.how, None, _why(e), c.strategy))
      continue
    out.append(Alternative(c.name, c.how, planned, "", c.strategy))
    if planned.fits:
      break
  return tuple(out)


def _why(e: Exception) -> str:
  first = (str(e).splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:200]}"


def _free_name(name: str, taken: tuple) -> str:
  while name in taken:
    name += "_"
  return name


def _moved(layout_map: LayoutMap | None, mesh: DeviceMesh) -> LayoutMap | None:
  """`layout_map`'s rules on `mesh` (which has every axis they name)."""
  if layout_map is None:
    return None
  moved = LayoutMap(mesh)
  for key in layout_map:
    moved[key] = tuple(layout_map[key])
  return moved
