"""`jdist.Diagnosis`: a step's times on 1 and N devices, advice and table."""

from __future__ import annotations

import dataclasses
import os

from jdist._src.diagnose.advice import Advice
from jdist._src.diagnose.advice import Facts
from jdist._src.diagnose.advice import advise
from jdist._src.diagnose.measure import PARTS
from jdist._src.diagnose.measure import StepTimes


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  """What `jdist.diagnose` found (advice by fixed rules); `print()` it.

  Attributes:
    single: `StepTimes` on one device.
    multi: `StepTimes` on the N-replica strategy.
    global_batch: examples per step.
    steps: steps per timed loop.
    platform: the devices' platform ("cpu", "gpu", "tpu").
    host_cores: CPU cores of the host that ran the step.
    measurement_notes: what the measurement could not do, if anything.
    bottleneck: where most of the N-device step goes ("input", ...).
    cause: why, in a sentence, with the numbers.
    fix: what to change.
    notes: other things worth knowing (host callbacks, shared CPU cores).

  Example:
    >>> import jdist
    >>> def times(n, compute, dispatch):
    ...   return jdist.StepTimes(
    ...       num_replicas=n, step=compute + dispatch, input_wait=0.0,
    ...       compute=compute, collectives=0.0, dispatch=dispatch,
    ...       compile_seconds=0.5, recompilations=0, host_callbacks=0,
    ...       collective_bytes=0, samples_per_second=64 / (compute + dispatch))
    >>> d = jdist.Diagnosis(single=times(1, 0.004, 0.001),
    ...                     multi=times(4, 0.001, 0.003), global_batch=64,
    ...                     steps=10, platform="gpu", host_cores=8)
    >>> d.bottleneck, d.fix.startswith("Raise the batch")
    ('dispatch', True)
  """

  single: StepTimes
  multi: StepTimes
  global_batch: int
  steps: int
  platform: str
  host_cores: int = dataclasses.field(
      default_factory=lambda: os.cpu_count() or 1)
  measurement_notes: tuple[str, ...] = ()

  @property
  def advice(self) -> Advice:
    """The bottleneck, cause, fix and notes the rules give for these times."""
    return advise(Facts(
        one=self.single, many=self.multi, global_batch=self.global_batch,
        platform=self.platform, host_cores=self.host_cores))

  @property
  def bottleneck(self) -> str:
    return self.advice.bottleneck

  @property
  def cause(self) -> str:
    return self.advice.cause

  @property
  def fix(self) -> str:
    return self.advice.fix

  @property
  def notes(self) -> tuple[str, ...]:
    return self.measurement_notes + self.advice.notes

  @property
  def speedup(self) -> float:
    """Samples per second on N replicas over those on one device."""
    return self.multi.samples_per_second / self.single.samples_per_second

  def table(self) -> str:
    """The diagnosis as a table a person reads at a glance."""
    one, many = self.single, self.multi
    found = self.advice

    def row(label, a, b, tail=""):
      return f"{label:<24}{a:>14}{b:>14}{tail}"

    def ms(t: StepTimes, part: str):
      x = getattr(t, part)
      return f"{1e3 * x:.3f}" + ("" if part == "step" else
                                f" {100 * x / t.step:3.0f}%")

    rows = [f"jdist.diagnose: global batch {self.global_batch}, "
            f"{self.steps} steps per loop",
            row("ms per step", "1 device", _devices(many)),
            row("step (as fed)", ms(one, "step"), ms(many, "step"))]
    rows += [row("  " + p.replace("_", " "), ms(one, p), ms(many, p))
             for p in PARTS]
    rows += [
        row("samples/s", f"{one.samples_per_second:,.0f}",
            f"{many.samples_per_second:,.0f}", f"  ({self.speedup:.2f}x)"),
        row("compile (first call)", f"{one.compile_seconds:.2f} s",
            f"{many.compile_seconds:.2f} s"),
        row("recompilations", one.recompilations, many.recompilations),
        row("host callbacks", one.host_callbacks, many.host_callbacks),
        row("collective bytes", "-", f"{many.collective_bytes:,}"),
    ]
    if len(many.collectives_by_axes) > 1 or (
        many.num_devices or many.num_replicas) > many.num_replicas:
      rows += [row(f"  over {axes}", "-", f"{size:,}", f"  ({count} ops)")
               for axes, count, size in many.collectives_by_axes]
    rows += [
        f"Bottleneck on {many.num_devices or many.num_replicas} devices: "
        f"{found.bottleneck}",
        f"  Cause: {found.cause}",
        f"  Fix:   {found.fix}",
    ]
    rows += [f"  Note:  {note}"
             for note in self.measurement_notes + found.notes]
    return "\n".join(rows)

  def __str__(self) -> str:
    return self.table()


def _devices(times: StepTimes) -> str:
  """The N-device column's heading."""
  n = times.num_devices or times.num_replicas
  if n == times.num_replicas:
    return f"{n} devices"
  return f"{n} dev/{times.num_replicas} rep"
