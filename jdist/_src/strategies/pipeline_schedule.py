"""`PipelineSchedule`: how a replica's stacked layers run as stages over a
mesh axis (GPipe, or circular with several virtual stages per device).

Virtual stage `q` (layers `[q L / (S V), (q + 1) L / (S V))`) runs on stage
`q % S`; at iteration `t` stage `s` runs unit `t - s` of its `V * M`
(see `work`).
"""

from __future__ import annotations

import dataclasses
import warnings

from jdist._src.errors import DistributionError


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """A pipeline's shape (`strategy.pipeline`), with MaxText's names.

  Attributes:
    axis: the mesh axis whose devices are the stages.
    num_stages: that axis's size, S.
    num_microbatches: M, the microbatches of each replica's batch.
    num_repeats: V, the virtual stages per stage (1: GPipe).
    remat: each stage's work is rematerialized in the backward pass.

  Example:
    >>> from jdist._src.strategies.pipeline_schedule import PipelineSchedule
    >>> s = PipelineSchedule("stage", num_stages=4, num_microbatches=8)
    >>> s.iterations, round(s.bubble_fraction, 4)
    (11, 0.2727)
  """

  axis: str
  num_stages: int
  num_microbatches: int
  num_repeats: int = 1
  remat: bool = False

  def __post_init__(self):
    for name in ("num_microbatches", "num_repeats"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a whole number of at least 1, got {value!r}.")
    s, m, v = self.num_stages, self.num_microbatches, self.num_repeats
    if v > 1 and m < s:
      raise ValueError(
          f"A circular pipeline (num_repeats={v}) needs at least as many "
          f"microbatches as stages: num_microbatches={m} < {s} stages over "
          f"{self.axis!r}. A microbatch comes back to the first stage {s} "
          "iterations after it left; with fewer microbatches that stage "
          f"would wait. Use num_microbatches >= {s}, or num_repeats=1.")
    if m < s:
      warnings.warn(
          f"num_microbatches={m} is less than the {s} pipeline stages over "
          f"{self.axis!r}: each stage idles {s - 1} of the loop's {m + s - 1} "
          f"iterations ({self.bubble_fraction:.0%} of the step is bubble). "
          f"Use num_microbatches >= {s} (a multiple, for a small bubble).",
          stacklevel=5)

  @property
  def iterations(self) -> int:
    """The loop's iterations: V * M + S - 1."""
    return self.num_repeats * self.num_microbatches + self.num_stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of each stage's iterations it idles: (S - 1) / (V*M + S - 1)."""
    return (self.num_stages - 1) / self.iterations

  def layers_per_stage(self, num_layers: int) -> int:
    """The layers each virtual stage runs: `num_layers / (S * V)`.

    Raises:
      jdist.DistributionError: `num_layers` is not a multiple of S * V.
    """
    parts = self.num_stages * self.num_repeats
    if num_layers % parts:
      repeats = (f" x {self.num_repeats} repeats (virtual stages per stage)"
                 if self.num_repeats > 1 else "")
      raise DistributionError(
          f"jdist.pipeline got {num_layers} stacked layers, which do not "
          f"split over {self.num_stages} stages{repeats} = {parts} parts. "
          f"Stack a multiple of {parts} layers, or change the mesh's "
          f"{self.axis!r} axis or num_repeats.")
    return num_layers // parts

  def microbatch_size(self, rows: int, num_replicas: int) -> int:
    """The rows of one microbatch of a replica's `rows`.

    Raises:
      jdist.DistributionError: `rows` is not a multiple of M.
    """
    m = self.num_microbatches
    if rows % m:
      raise DistributionError(
          f"jdist.pipeline got a replica's batch of {rows} rows, which does "
          f"not split into num_microbatches={m} microbatches. Use a global "
          f"batch that is a multiple of replicas x num_microbatches = "
          f"{num_replicas} x {m} = {num_replicas * m} (times the Trainer's "
          "micro_batches, if set), or another num_microbatches.")
    return rows // m

  def work(self, iteration: int, stage: int) -> tuple[int, int] | None:
    """`(microbatch, repeat)` that `stage` runs at `iteration`, or None."""
    k = iteration - stage
    if not 0 <= k < self.num_repeats * self.num_microbatches:
      return None
    return k % self.num_microbatches, k // self.num_microbatches
