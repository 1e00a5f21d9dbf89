"""What a diagnosis concludes from its times: advice as rows of a table.

The first of `RULES` that holds names the bottleneck; every `NOTES` row that
holds adds a note. Adding advice is adding a row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jdist._src.diagnose.measure import PARTS
from jdist._src.diagnose.measure import StepTimes


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the rules read: the step's times on 1 and N devices, and where."""

  one: StepTimes
  many: StepTimes
  global_batch: int
  platform: str
  host_cores: int

  @property
  def n(self) -> int:
    """Devices of the N-device run (a replica may span several)."""
    return self.many.num_devices or self.many.num_replicas

  @property
  def largest(self) -> str:
    """The largest part of the N-device step (the first, on a tie)."""
    return max(PARTS, key=lambda part: getattr(self.many, part))

  @property
  def compute_speedup(self) -> float:
    """One device's compute time over one of N devices'."""
    if not self.many.compute:
      return math.inf
    return self.one.compute / self.many.compute

  def words(self) -> dict:
    """The values the templates name, formatted for a sentence."""
    one, many = self.one, self.many
    ms = lambda seconds: f"{1e3 * seconds:.2f} ms"  # noqa: E731
    largest = getattr(many, self.largest)
    share = largest / many.step if many.step else 0.0
    return {
        "n": self.n, "share": f"{100 * share:.0f}% of the step",
        "recompilations": many.recompilations,
        "compile": ms(many.compile_seconds),
        "input_wait": ms(many.input_wait), "compute": ms(many.compute),
        "collectives": ms(many.collectives), "dispatch": ms(many.dispatch),
        "device": ms(many.compute + many.collectives),
        "one_compute": ms(one.compute),
        "compute_speedup": f"{self.compute_speedup:.1f}",
        "collective_bytes": f"{many.collective_bytes:,}",
        "global_batch": self.global_batch,
        "per_replica": self.global_batch // self.many.num_replicas,
        "samples_one": f"{one.samples_per_second:,.0f}",
        "samples_many": f"{many.samples_per_second:,.0f}",
        "host_cores": self.host_cores, "host_callbacks": many.host_callbacks,
    }


@dataclasses.dataclass(frozen=True)
class Rule:
  """A bottleneck, when it is the one, and what to say about it."""

  bottleneck: str
  when: Callable[[Facts], bool]
  cause: str
  fix: str


@dataclasses.dataclass(frozen=True)
class Note:
  """Something worth knowing, and when it is."""

  when: Callable[[Facts], bool]
  text: str


_SLOWER_THAN_N = ("the computation ({share}) takes {compute} on {per_replica} "
                  "examples per replica against {one_compute} for all "
                  "{global_batch} on one device: {compute_speedup}x faster, "
                  "not {n}x.")
_CPU_SHARED = ("CPU devices share the host's cores (see the note): expect "
               "little more from more of them here. On GPUs or TPUs, give each "
               "replica enough examples to keep its device busy.")

RULES = (
    Rule("recompilation", lambda f: f.many.recompilations > 0,
         cause="the step compiled {recompilations} more times while the loop "
         "ran (each compilation takes {compile}): the batches change shape, "
         "dtype or structure.",
         fix="Keep batch shapes fixed: pad to a fixed size (distributed "
         "datasets pad a short last batch for you) and pass numbers as "
         "arrays, not static arguments."),
    Rule("input", lambda f: f.largest == "input_wait",
         cause="the devices wait {input_wait} for each batch ({share}): "
         "reading, preparing and copying the batches is slower than the step.",
         fix="Prepare batches ahead of the loop and in parallel (tf.data or "
         "grain with prefetch and workers), cache decoded data in memory, or "
         "do more work per batch (a larger batch)."),
    Rule("collectives", lambda f: f.largest == "collectives",
         cause="the all-reduce of {collective_bytes} bytes a step takes "
         "{collectives} ({share}), more than computing on {per_replica} "
         "examples per replica.",
         fix="Raise the batch per replica (compute grows with it, the "
         "all-reduce does not), or accumulate gradients over several batches "
         "before reducing them."),
    Rule("dispatch", lambda f: f.largest == "dispatch",
         cause="a step computes for {device} but launching it from the host "
         "takes {dispatch} ({share}): the model is too small for {n} devices.",
         fix="Raise the batch, or run several steps per dispatch "
         "(steps_per_execution: jdist.Trainer(..., steps_per_execution=K))."),
    Rule("compute", lambda f: f.compute_speedup >= 0.75 * f.n,
         cause="the computation itself ({share}), {compute_speedup}x faster "
         "than on one device: the time goes where it should.",
         fix="Nothing in the loop to fix; for more speed use more devices, "
         "mixed precision, or a cheaper model."),
    Rule("compute", lambda f: f.platform == "cpu",
         cause=_SLOWER_THAN_N,
         fix=_CPU_SHARED),
    Rule("compute", lambda f: True,
         cause=_SLOWER_THAN_N,
         fix="Give each replica enough work to keep its device busy: raise "
         "the global batch with the replicas (per-replica batch x "
         "num_replicas_in_sync)."),
)

NOTES = (
    Note(lambda f: f.one.step < f.many.step,
         "{n} devices are slower than one ({samples_many} against "
         "{samples_one} samples/s)."),
    Note(lambda f: f.platform == "cpu",
         "{n} CPU devices share this host's {host_cores} cores, and one "
         "device alone already uses several for large operations: on CPU, "
         "{n} devices cannot compute {n} times as fast. GPUs and TPUs each "
         "have their own."),
    Note(lambda f: f.many.host_callbacks > 0,
         "The step calls back to Python {host_callbacks} times "
         "(jax.debug.print, pure_callback, io_callback): each one stops the "
         "devices until the host answers. Remove them from the training "
         "step."),
)


@dataclasses.dataclass(frozen=True)
class Advice:
  """The bottleneck, its cause and fix, and the notes."""

  bottleneck: str
  cause: str
  fix: str
  notes: tuple[str, ...]


def advise(facts: Facts) -> Advice:
  """The first rule that holds, and every note that does."""
  words = facts.words()
  rule = next(rule for rule in RULES if rule.when(facts))
  return Advice(rule.bottleneck, rule.cause.format_map(words),
                rule.fix.format_map(words),
                tuple(note.text.format_map(words) for note in NOTES
                      if note.when(facts)))
