"""When each pipeline stage works: a layer wrapped to record, on the host,
the moments each stage starts and ends it, forward and backward.

`timed(layer_fn, timeline)` is a layer for `jdist.pipeline` whose every run
calls back to Python (`jax.pure_callback`: an effect-free callback, which
`jdist.pipeline`'s checkpointed stages accept; its result is used, so it is
never dropped) as it starts and as it ends, with its stage's index; its
backward pass (a `jax.custom_vjp`) does the same. The `Timeline` keeps the times, and from them each stage's busy
intervals, its bubble (idle before its first layer and after its last, over
the loop's span: measured rather than assumed) and all its idle time. The callbacks cost the devices a round trip
to the host each (tens of microseconds on CPU): use layers that take
longer than that. Runs only inside a pipeline (it reads the stage's index
from the pipeline axis); mesh axes other than the replicas' and the
stages' must have size 1, since a callback inside a computation that XLA
partitions over an axis runs on one device of it.

Example (two stages of one layer each, four microbatches):
  >>> import jax, jax.numpy as jnp, numpy as np, jdist
  >>> from jdist.examples.pipeline_timeline import Timeline, timed
  >>> mesh = jdist.DeviceMesh((1, 2), ("data", "stage"), jax.devices()[:2])
  >>> layout_map = jdist.LayoutMap(mesh)
  >>> layout_map["w"] = ("stage", None, None)
  >>> strategy = jdist.ModelParallelStrategy(
  ...     layout_map=layout_map, pipeline_axis="stage", num_microbatches=4)
  >>> timeline = Timeline()
  >>> layer = timed(lambda w, h: jnp.tanh(h @ w), timeline)
  >>> step = strategy.function(lambda p, x: jdist.pipeline(layer, p["w"], x))
  >>> w = strategy.init(lambda: {"w": jnp.ones((2, 8, 8)) / 8})
  >>> _ = jax.block_until_ready(step(w, jnp.ones((8, 8))))
  >>> [len(timeline.intervals()[s]) for s in (0, 1)]  # 4 microbatches each
  [4, 4]
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_STARTS, _ENDS = 0, 1
PHASES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Interval:
  """One stage's run of one layer.

  Attributes:
    stage: the stage's index on the pipeline axis.
    phase: "forward" or "backward".
    start: `time.perf_counter()` when it started.
    end: when it ended.
  """

  stage: int
  phase: str
  start: float
  end: float


class Timeline:
  """The times the stages started and ended their layers, as recorded."""

  def __init__(self):
    self._lock = threading.Lock()
    self._events: list = []  # (time, stage, phase, edge)

  def record(self, stage, phase, edge) -> np.ndarray:
    """Called back from the devices: notes the time; returns 0.0 (added to
    the data, so that the computation waits for it)."""
    now = time.perf_counter()
    with self._lock:
      self._events.append((now, int(stage), int(phase), int(edge)))
    return np.zeros((), np.float32)

  def clear(self) -> None:
    """Forgets what was recorded (between a compiling call and a timed one)."""
    with self._lock:
      self._events.clear()

  def events(self) -> np.ndarray:
    """What was recorded, one row per event in time order: its time, stage,
    phase (0 forward, 1 backward) and edge (0 start, 1 end), as float64.

    A pipeline whose stages are processes records each stage's events in
    its own process: gather the rows, then `Timeline.of` them.
    """
    with self._lock:
      return np.array(sorted(self._events), np.float64).reshape(-1, 4)

  @classmethod
  def of(cls, events: np.ndarray) -> "Timeline":
    """A timeline holding `events` (rows as `events()` gives them, from one
    timeline or several: times from `time.perf_counter`, one clock for
    every process of a machine)."""
    timeline = cls()
    timeline.add(events)
    return timeline

  def add(self, events: np.ndarray) -> None:
    """Adds `events` (rows as `events()` gives them) to those recorded."""
    rows = [(float(t), int(s), int(p), int(e))
            for t, s, p, e in np.asarray(events).reshape(-1, 4)]
    with self._lock:
      self._events.extend(rows)

  def intervals(self) -> dict[int, list[Interval]]:
    """Each stage's intervals in time order: its starts and ends paired in
    the order they came (a stage runs one layer at a time)."""
    with self._lock:
      events = sorted(self._events)
    open_at: dict = {}
    out: dict[int, list[Interval]] = {}
    for now, stage, phase, edge in events:
      if edge == _STARTS:
        open_at[(stage, phase)] = now
      elif (stage, phase) in open_at:
        out.setdefault(stage, []).append(Interval(
            stage, PHASES[phase], open_at.pop((stage, phase)), now))
    return out

  def _spans(self, phase: str | None) -> tuple[list, dict, float]:
    """The phases counted, each stage's intervals, and the spans added."""
    phases = PHASES if phase is None else (phase,)
    by_stage = self.intervals()
    every = [i for rows in by_stage.values() for i in rows]
    spans = {p: (min(i.start for i in every if i.phase == p),
                 max(i.end for i in every if i.phase == p))
             for p in phases if any(i.phase == p for i in every)}
    return spans, by_stage, sum(end - start for start, end in spans.values())

  def bubble_fraction(self, phase: str | None = None) -> dict[int, float]:
    """Each stage's bubble: its idle time before its first layer and after
    its last, in each phase's loop (the span from the first stage's start
    to the last stage's end), over the spans (of `phase`, or both phases'
    added). What the schedule makes a stage wait, measured: idle gaps
    between its layers (passing activations on, the loop's bookkeeping)
    are `idle_fraction`'s, not the bubble's."""
    spans, by_stage, total = self._spans(phase)
    out = {}
    for stage, rows in sorted(by_stage.items()):
      idle = 0.0
      for p, (start, end) in spans.items():
        mine = [i for i in rows if i.phase == p]
        idle += (min(i.start for i in mine) - start) + (
            end - max(i.end for i in mine))
      out[stage] = idle / total
    return out

  def idle_fraction(self, phase: str | None = None) -> dict[int, float]:
    """Each stage's whole idle share of the spans: 1 - its busy time over
    the spans (the bubble and the gaps between its layers)."""
    spans, by_stage, total = self._spans(phase)
    return {stage: 1 - sum(i.end - i.start for i in rows
                           if i.phase in spans) / total
            for stage, rows in sorted(by_stage.items())}


def _mark(timeline: Timeline, stage, phase: int, edge: int, tree: Any) -> Any:
  """`tree`, after a callback that records `edge` once `tree` is computed
  (a start: before what uses it runs; an end: after what made it).

  The callback returns 0.0, added to every leaf: a dependence the compiler
  cannot remove (it drops an optimization barrier), at the cost of one
  elementwise pass.
  """
  leaf = jax.tree.leaves(tree)[0]
  zero = jax.pure_callback(
      lambda s, _: timeline.record(s, phase, edge),
      jax.ShapeDtypeStruct((), jnp.float32), stage, jnp.ravel(leaf)[0])
  return jax.tree.map(lambda a: a + zero.astype(a.dtype), tree)


def timed(layer_fn: Callable, timeline: Timeline, axis: str = "stage"
          ) -> Callable:
  """`layer_fn`, recording in `timeline` when each stage runs it, forward
  and backward (see the module's docstring).

  Args:
    layer_fn: a layer for `jdist.pipeline`, `(params, x) -> x`.
    timeline: where the times go.
    axis: the pipeline's mesh axis.

  Returns:
    The timed layer, the same function of its arguments.
  """
  def forward(params, h):
    stage = lax.axis_index(axis)
    h = _mark(timeline, stage, 0, _STARTS, h)
    y, vjp = jax.vjp(layer_fn, params, h)
    return _mark(timeline, stage, 0, _ENDS, y), vjp

  @jax.custom_vjp
  def layer(params, h):
    return forward(params, h)[0]

  def backward(vjp, cotangent):
    stage = lax.axis_index(axis)
    cotangent = _mark(timeline, stage, 1, _STARTS, cotangent)
    grads = _mark(timeline, stage, 1, _ENDS, vjp(cotangent))
    return grads

  layer.defvjp(forward, backward)
  return layer
