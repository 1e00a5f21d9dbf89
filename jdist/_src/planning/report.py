"""`jdist.Plan`: a step's memory, FLOPs and layout, known before it runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from jdist._src.errors import MemoryBudgetError
from jdist._src.planning import peaks
from jdist._src.planning.memory import KINDS, OPTIMIZER, PARAMETERS
from jdist._src.planning.memory import format_bytes


@dataclasses.dataclass(frozen=True)
class Alternative:
  """Another layout of the same step on the same devices: its name, code,
  `Plan` (or why it could not be planned) and strategy."""

  name: str
  how: str
  plan: Any = None
  problem: str = ""
  strategy: Any = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one device holds and does in a step (bytes per device).

  Attributes:
    strategy: the strategy's repr.
    platform: the devices' platform ("cpu", "gpu", "tpu").
    device_kind: the devices' kind as JAX reports it ("TPU v5 lite").
    num_devices: devices the step runs on.
    num_replicas: replicas (a replica may span devices).
    mesh: `((axis, size), ...)`.
    arguments: `((kind, bytes), ...)`: the step's arguments by kind.
    output_bytes: the step's output arrays (their blocks on a device).
    alias_bytes: outputs written into donated arguments' buffers.
    temp_bytes: the compiled program's temporary allocation.
    program_argument_bytes: the compiled program's arguments.
    program_output_bytes: the compiled program's outputs, address table too.
    flops_per_device: XLA's count of the FLOPs one device runs per step.
    model_flops: FLOPs per step by the model's own count, or None.
    compute_dtype: the dtype most matrix products take, or None.
    peak_flops_per_device: the device's dense peak FLOP/s in that dtype.
    collectives: `((axes, kind, count, bytes), ...)` per step and device.
    largest: `((path, kind, bytes), ...)`: the largest arrays per device.
    notes: layout notes.
    memory_limit: the bytes a device may use, or None if not known.
    memory_limit_source: where `memory_limit` comes from.
    alternatives: other layouts planned because this one does not fit.
  """

  strategy: str
  platform: str
  device_kind: str
  num_devices: int
  num_replicas: int
  mesh: tuple
  arguments: tuple
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  program_argument_bytes: int
  program_output_bytes: int
  flops_per_device: float
  model_flops: float | None
  compute_dtype: str | None
  peak_flops_per_device: float | None
  collectives: tuple
  largest: tuple
  notes: tuple = ()
  memory_limit: int | None = None
  memory_limit_source: str = ""
  alternatives: tuple = ()

  # --- derived numbers ---------------------------------------------------

  def argument(self, kind: str) -> int:
    """Bytes per device of the arguments of `kind`."""
    return dict(self.arguments).get(kind, 0)

  @property
  def argument_bytes(self) -> int:
    """All the step's arguments, per device."""
    return sum(b for _, b in self.arguments)

  @property
  def state_bytes(self) -> int:
    """Parameters and optimizer state, per device."""
    return self.argument(PARAMETERS) + self.argument(OPTIMIZER)

  @property
  def peak_bytes(self) -> int:
    """Per device while the step runs: arguments, outputs that reuse no
    donated buffer, and temporaries."""
    return (self.program_argument_bytes + self.program_output_bytes -
            self.alias_bytes + self.temp_bytes)

  @property
  def flops(self) -> float:
    """FLOPs per step over all devices, by XLA's count of the program."""
    return self.flops_per_device * self.num_devices

  @property
  def fits(self) -> bool | None:
    """Whether the peak fits `memory_limit` (None: no limit known)."""
    if self.memory_limit is None:
      return None
    return self.peak_bytes <= self.memory_limit

  def throughput(self, seconds_per_step: float) -> peaks.Throughput:
    """Achieved FLOP/s and MFU ("n/a" where the peak is unknown) for a
    measured step time.

    Args:
      seconds_per_step: the measured wall time of one step.
    """
    return peaks.throughput(
        flops_per_device=self.flops_per_device, num_devices=self.num_devices,
        model_flops=self.model_flops,
        peak_per_device=self.peak_flops_per_device,
        seconds_per_step=seconds_per_step)

  # --- for programs and people -----------------------------------------

  def as_dict(self) -> dict:
    """The plan as plain numbers and strings (alternatives as dicts)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["arguments"] = dict(self.arguments)
    out["mesh"] = dict(self.mesh)
    out["collectives"] = [dict(zip(("axes", "kind", "count", "bytes"), row))
                          for row in self.collectives]
    out["largest"] = [dict(zip(("path", "kind", "bytes"), row))
                      for row in self.largest]
    out["notes"] = list(self.notes)
    out["alternatives"] = [
        {"name": a.name, "how": a.how, "problem": a.problem,
         "plan": None if a.plan is None else a.plan.as_dict()}
        for a in self.alternatives]
    out.update(argument_bytes=self.argument_bytes, peak_bytes=self.peak_bytes,
               flops=self.flops, fits=self.fits)
    return out

  def check(self) -> "Plan":
    """Raises `jdist.MemoryBudgetError` (naming the largest parts and a
    layout that fits) when the step's peak exceeds the memory limit; returns
    the plan otherwise."""
    if self.fits is False:
      raise MemoryBudgetError(self.budget_message())
    return self

  def budget_message(self) -> str:
    """Why the step does not fit, and what would."""
    parts = sorted([(k, b) for k, b in self.arguments if b] +
                   [("temporaries", self.temp_bytes)], key=lambda kb: -kb[1])
    lines = [
        f"The step needs {format_bytes(self.peak_bytes)} "
        f"({self.peak_bytes:,} bytes) per device at its peak, over the "
        f"{format_bytes(self.memory_limit)} ({self.memory_limit:,} bytes) a "
        f"device may use ({self.memory_limit_source}), under {self.strategy};"
        " found by compiling it, before any step ran.",
        "Largest per device: " + ", ".join(
            f"{k} {format_bytes(b)}" for k, b in parts[:4]) + "; arrays: " +
        ", ".join(f"{p} {format_bytes(b)}" for p, _, b in self.largest[:3])
        + "."]
    lines.append(_what_fits(self))
    return "\n".join(lines)

  def table(self) -> str:
    """The plan as a table a person reads at a glance."""
    return "\n".join(_table(self))

  def __str__(self) -> str:
    return self.table()


def change(plan: Plan, other: Plan) -> str:
  """`other` against `plan`: "parameters + optimizer state A -> B; ..."."""
  limit = other.memory_limit
  fits = "" if limit is None else (
      f" ({'fits' if other.fits else 'over'} {format_bytes(limit)})")
  return (f"parameters + optimizer state {format_bytes(plan.state_bytes)} -> "
          f"{format_bytes(other.state_bytes)}; peak "
          f"{format_bytes(plan.peak_bytes)} -> "
          f"{format_bytes(other.peak_bytes)}{fits}")


def _what_fits(plan: Plan) -> str:
  planned = [a for a in plan.alternatives if a.plan is not None]
  fitting = [a for a in planned if a.plan.fits]
  if fitting:
    a = fitting[0]
    return (f"What fits (compiled and planned): {a.name}: "
            f"{change(plan, a.plan)}. Ask for it with {a.how}.")
  if planned:
    a = min(planned, key=lambda a: a.plan.peak_bytes)
    return (f"No other layout on these {plan.num_devices} devices fits: the "
            f"smallest planned is {a.name}: {change(plan, a.plan)}. Use more "
            "devices, a smaller batch per replica (micro_batches=, "
            "gradient_accumulation_steps=), or lower precision.")
  tried = "; ".join(f"{a.name}: {a.problem}" for a in plan.alternatives)
  return ("No alternative layout could be planned" +
          (f" ({tried})" if tried else "") + ". Use more devices, a smaller "
          "batch per replica, or lower precision.")


def _table(plan: Plan) -> list[str]:
  def row(label, value, tail=""):
    return f"  {label:<34}{value:>12}{tail}"

  mesh = ", ".join(f"{n}={s}" for n, s in plan.mesh)
  rows = [f"jdist.plan: {plan.strategy}",
          f"  {plan.num_devices} {plan.device_kind} device(s), "
          f"{plan.num_replicas} replica(s), mesh ({mesh})",
          "per device"]
  rows += [row(kind, format_bytes(plan.argument(kind))) for kind in KINDS]
  rows += [row("outputs", format_bytes(plan.output_bytes),
               f"  ({format_bytes(plan.alias_bytes)} in donated buffers)"),
           row("temporaries", format_bytes(plan.temp_bytes)),
           row("peak", format_bytes(plan.peak_bytes), _limit(plan))]
  rows += _flops_rows(plan, row)
  if plan.collectives:
    rows.append("collectives per step (result bytes per device)")
    rows += [row(f"over {axes}: {kind}", format_bytes(size), f"  x{count}")
             for axes, kind, count, size in plan.collectives]
  rows.append("largest arrays per device")
  rows += [f"  {path}  ({kind})  {format_bytes(size)}"
           for path, kind, size in plan.largest]
  rows += [f"note: {note}" for note in plan.notes]
  for a in plan.alternatives:
    rows.append(f"alternative: {a.name}: " + (
        change(plan, a.plan) if a.plan is not None else a.problem))
  return rows


def _flops_rows(plan: Plan, row) -> list[str]:
  model = ("" if plan.model_flops is None else
           f"  (model's count {peaks.format_flops(plan.model_flops)})")
  peak = ("n/a" if plan.peak_flops_per_device is None else
          peaks.format_flops(plan.peak_flops_per_device) + "/s")
  return [row("FLOPs per step", peaks.format_flops(plan.flops),
              f"  ({plan.num_devices} x "
              f"{peaks.format_flops(plan.flops_per_device)}, compiled){model}"),
          row("compute dtype", str(plan.compute_dtype or "-"),
              f"  (peak per device {peak})")]


def _limit(plan: Plan) -> str:
  if plan.memory_limit is None:
    return "  (no memory limit known: memory_budget=)"
  verdict = "fits" if plan.fits else "DOES NOT FIT"
  return (f"  {verdict} {format_bytes(plan.memory_limit)} "
          f"({plan.memory_limit_source})")
