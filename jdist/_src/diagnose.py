"""`jdist.diagnose`: where a training step's time goes, on 1 and on N devices.

`diagnose`'s docstring says how each number is measured; nothing is modelled.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import time
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._src.core import placement
from jdist._src.equivalence import devices_hint
from jdist._src.strategies.mirrored import MirroredStrategy, OneDeviceStrategy

# The parts of a step's time, in the order the table shows them.
_PARTS = ("input_wait", "compute", "collectives", "overhead")
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
          "c64": 8, "c128": 16}
_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"')


@dataclasses.dataclass(frozen=True)
class StepTimes:
  """Where one strategy's step time goes, in seconds per step.

  `input_wait + compute + collectives + overhead == step`.

  Attributes:
    num_replicas: replicas of the strategy.
    step: a step as the loop runs it, fed host batches.
    input_wait: waiting for the next batch (reading, splitting, copying).
    compute: the step's computation on the devices.
    collectives: the step's all-reduces (and other collectives).
    overhead: dispatching the step and waiting for it (host syncs).
    compile_seconds: compiling the step (its first call, less one step).
    recompilations: compilations after the first, while the loops ran.
    host_callbacks: callbacks to Python compiled into the step.
    collective_bytes: bytes the step's collectives carry, per replica.
    samples_per_second: global batch / `step`.
  """

  num_replicas: int
  step: float
  input_wait: float
  compute: float
  collectives: float
  overhead: float
  compile_seconds: float
  recompilations: int
  host_callbacks: int
  collective_bytes: int
  samples_per_second: float


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  """What `jdist.diagnose` found; `print()` it for a table.

  Attributes:
    single: `StepTimes` on one device.
    multi: `StepTimes` on the N-replica strategy.
    global_batch: examples per step.
    steps: steps per timed loop.
    bottleneck: where most of the N-device step goes: "input",
      "compute", "collectives", "overhead" (dispatch and host syncs) or
      "recompilation" (the step compiled again during the loop).
    cause: why, in a sentence, with the numbers.
    fix: what to change.
    notes: other things worth knowing (host callbacks, shared CPU cores).
  """

  single: StepTimes
  multi: StepTimes
  global_batch: int
  steps: int
  bottleneck: str
  cause: str
  fix: str
  notes: tuple = ()

  @property
  def speedup(self) -> float:
    """Samples per second on N replicas over those on one device."""
    return self.multi.samples_per_second / self.single.samples_per_second

  def table(self) -> str:
    """The diagnosis as a table a person reads at a glance."""
    one, many = self.single, self.multi
    n = many.num_replicas

    def row(label, a, b, tail=""):
      return f"{label:<24}{a:>14}{b:>14}{tail}"

    def ms(t: StepTimes, part: str):
      x = getattr(t, part)
      return f"{1e3 * x:.3f}" + ("" if part == "step" else
                                f" {100 * x / t.step:3.0f}%")

    labels = {"input_wait": "input wait", "compute": "compute",
              "collectives": "collectives", "overhead": "dispatch, host syncs"}
    rows = [f"jdist.diagnose: global batch {self.global_batch}, "
            f"{self.steps} steps per loop",
            row("ms per step", "1 device", f"{n} devices"),
            row("step (as fed)", ms(one, "step"), ms(many, "step"))]
    rows += [row("  " + labels[p], ms(one, p), ms(many, p)) for p in _PARTS]
    rows += [
        row("samples/s", f"{one.samples_per_second:,.0f}",
            f"{many.samples_per_second:,.0f}", f"  ({self.speedup:.2f}x)"),
        row("compile (first call)", f"{one.compile_seconds:.2f} s",
            f"{many.compile_seconds:.2f} s"),
        row("recompilations", one.recompilations, many.recompilations),
        row("host callbacks", one.host_callbacks, many.host_callbacks),
        row("collective bytes", "-", f"{many.collective_bytes:,}"),
        f"Bottleneck on {n} devices: {self.bottleneck}",
        f"  Cause: {self.cause}",
        f"  Fix:   {self.fix}",
    ]
    rows += [f"  Note:  {note}" for note in self.notes]
    return "\n".join(rows)

  def __str__(self) -> str:
    return self.table()


def diagnose(step: Callable, state: Any, batches: Iterable, *,
             strategy=None, num_replicas: int | None = None,
             steps: int = 10) -> Diagnosis:
  """Runs a training step on 1 and on N devices and says where the time goes.

  The step is `step(state, batch) -> (state, outputs)`, as for
  `jdist.testing.assert_equivalent`, or a `strategy.function` /
  `@jdist.mirrored` step (its strategy is then the N-device one). Every loop
  starts from `state`; nothing changes the caller's values.

  How each number is measured, on one device and on the N-replica strategy,
  over the first `steps` (K) batches, after a first call that compiles:

  - `step`: seconds per step of the loop as users write it
    (`state, out = step(state, batch)`), fed the host batches through
    `experimental_distribute_dataset`;
  - `input_wait`: `step` minus the same loop over batches already placed on
    the devices before the clock started;
  - `compute + collectives` (the device time): the step run K times inside
    one compiled program (`lax.fori_loop` under `jax.jit`, one dispatch);
  - `collectives`: the compiled step's all-reduces (all-gathers, ...), read
    from its HLO with their sizes, run alone K times in one program on the
    same devices;
  - `overhead` (dispatch, host syncs): the placed loop's step minus the
    device time (launching each step, waiting for the previous one);
  - `compile_seconds`: the first call less one step; `recompilations`:
    compilations while the timed loops ran (batches that change shape);
  - `host_callbacks`: calls back to Python compiled into the step
    (`jax.debug.print`, `pure_callback`, `io_callback`); their time is part
    of the device time.

  Each loop runs twice and the faster run counts; on a shared machine the
  numbers still move by tens of percent, so read the split, not the digits.
  The bottleneck is the largest part on N devices (or recompilation, if the
  step recompiled), and the cause and fix follow from it.

  Args:
    step: the per-replica training step.
    state: the initial state (a pytree; placed on each strategy here).
    batches: a re-iterable of global batches (a list, or an object whose
      `__iter__` starts over): the loops read it several times.
    strategy: the N-replica strategy; default a `MirroredStrategy` over
      `num_replicas` local devices (all of them by default).
    num_replicas: replicas, when `strategy` is not given.
    steps: steps per timed loop (more: steadier numbers, slower).

  Returns:
    A frozen `Diagnosis`; `print(diagnosis)` shows the table.

  Raises:
    TypeError: `step` is not callable or does not return `(state,
      outputs)`; `batches` is a one-shot iterator.
    ValueError: no batches, `steps` < 1, a strategy with one replica or one
      that spans processes, or more replicas than local devices.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, numpy as np
    >>> def train_step(w, batch):
    ...   loss_fn = lambda w: jdist.compute_average_loss((batch @ w) ** 2)
    ...   loss, g = jax.value_and_grad(loss_fn)(w)
    ...   return w - 0.1 * g, loss
    >>> data = [np.ones((8, 3), np.float32)] * 4
    >>> d = jdist.diagnose(train_step, jnp.ones(3), data, num_replicas=2,
    ...                    steps=2)
    >>> d.multi.num_replicas, d.bottleneck in ("input", "compute",
    ...     "collectives", "overhead", "recompilation")
    (2, True)
  """
  fn = getattr(step, "python_function", step)
  if not callable(fn):
    raise TypeError(f"diagnose needs a step function, got {type(step).__name__}: "
                    "pass step(state, batch) -> (state, outputs).")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be a positive int, got {steps!r}.")
  if iter(batches) is batches:
    raise TypeError(
        "diagnose reads the batches several times (fed and pre-placed, on 1 "
        "and on N devices), but got a one-shot iterator. Pass a list, or an "
        "object whose __iter__ starts over (a tf.data or grain dataset).")
  strategy = _multi_strategy(step, strategy, num_replicas)
  single = OneDeviceStrategy(strategy.devices[0])
  one, _ = _measure(single, fn, state, batches, steps)
  many, run = _measure(strategy, fn, state, batches, steps)
  return _conclude(one, many, run, strategy)


def _multi_strategy(step, strategy, num_replicas):
  if strategy is not None and num_replicas is not None:
    raise ValueError("Pass strategy or num_replicas, not both.")
  if strategy is None and hasattr(step, "python_function"):
    strategy = step.strategy  # a jdist step: its own strategy
  if strategy is None:
    n = num_replicas or len(jax.local_devices())
    if n > len(jax.local_devices()):
      raise ValueError(devices_hint(n))
    strategy = MirroredStrategy(jax.local_devices()[:n])
  if strategy.num_replicas_in_sync < 2:
    raise ValueError(
        f"diagnose compares one device with several, but {strategy!r} has one "
        "replica. " + devices_hint(2))
  if placement.spans_processes(strategy.mesh):
    raise ValueError(
        "diagnose measures this process's devices; its strategy spans "
        "processes. Diagnose on one host with MirroredStrategy() (the step "
        "and batches are the same).")
  return strategy


def _block(tree) -> None:
  jax.block_until_ready([x for x in jax.tree.leaves(tree)
                         if isinstance(x, jax.Array)])


def _loop(step, state, items) -> float:
  """Seconds for the loop `state, _ = step(state, batch)` over `items`."""
  start = time.perf_counter()
  out = None
  for batch in items:
    state, out = step(state, batch)
  _block((state, out))
  return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class _Run:
  global_batch: int
  steps: int
  notes: tuple


def _measure(strategy, fn, state, batches, steps: int):
  """The `StepTimes` of `fn` on `strategy`, and what else the run saw."""
  def fed():
    return itertools.islice(strategy.experimental_distribute_dataset(batches),
                            steps)

  placed = list(fed())
  if not placed:
    raise ValueError("diagnose got no batches: pass at least one global batch.")
  k = len(placed)
  step = strategy.function(fn)
  initial = strategy.replicate(state)
  start = time.perf_counter()
  result = step(initial, placed[0])
  _block(result)
  first_call = time.perf_counter() - start
  if not (isinstance(result, (tuple, list)) and len(result) == 2):
    raise TypeError(
        f"diagnose runs `state, outputs = step(state, batch)` in a loop, but "
        f"{getattr(fn, '__name__', 'the step')} returned "
        f"{type(result).__name__}. Return (new_state, outputs).")
  compiled = step.num_compilations
  on_devices = min(_loop(step, initial, placed) for _ in range(2)) / k
  as_fed = min(_loop(step, initial, fed()) for _ in range(2)) / k
  recompilations = step.num_compilations - compiled
  notes = ()
  try:
    # Never more than the loop's step: the loop contains the same work.
    device = min(_device_time(strategy, fn, initial, placed[0], k), on_devices)
  except Exception as e:  # noqa: BLE001  (a measurement, not the user's run)
    device = on_devices
    notes = (f"The step could not run {k} times in one program "
             f"({type(e).__name__}: {str(e).splitlines()[0][:120]}), so "
             "dispatch and host syncs are counted in compute.",)
  hlo = step.lower(initial, placed[0]).compile().as_text()
  sizes = _collective_sizes(hlo) if strategy.num_replicas_in_sync > 1 else []
  collectives = min(_collective_time(strategy, sizes, k), device)
  leaf = jax.tree.leaves(placed[0].values)[0]  # (replicas, per replica, ...)
  global_batch = leaf.shape[0] * leaf.shape[1]
  as_fed = max(as_fed, on_devices)
  times = StepTimes(
      num_replicas=strategy.num_replicas_in_sync, step=as_fed,
      input_wait=as_fed - on_devices, compute=device - collectives,
      collectives=collectives, overhead=max(on_devices - device, 0.0),
      compile_seconds=max(first_call - on_devices, 0.0),
      recompilations=recompilations,
      host_callbacks=len(_CALLBACK.findall(hlo)),
      collective_bytes=sum(sizes),
      samples_per_second=global_batch / as_fed)
  return times, _Run(global_batch, k, notes)


def _device_time(strategy, fn, state, batch, k: int) -> float:
  """Seconds per step with K steps in one compiled program (no dispatch)."""
  inner = strategy.function(fn)
  many = jax.jit(lambda s, b: jax.lax.fori_loop(
      0, k, lambda i, c: inner(c, b)[0], s))
  _block(many(state, batch))
  start = time.perf_counter()
  _block(many(state, batch))
  return (time.perf_counter() - start) / k


def _collective_sizes(hlo: str) -> list:
  """Bytes of each collective of a compiled program (per device)."""
  sizes = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      sizes.append(sum(
          _BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",")
                                              if d] or [1]))
          for dtype, dims in _SHAPE.findall(m.group(1))))
  return sizes


def _collective_time(strategy, sizes: list, k: int) -> float:
  """Seconds per step for all-reduces of `sizes` bytes, K rounds in one
  program on the strategy's devices."""
  if not sizes:
    return 0.0
  axis, n = strategy.axis_name, strategy.num_replicas_in_sync

  def rounds(*xs):
    return jax.lax.fori_loop(
        0, k, lambda i, xs: tuple(jax.lax.psum(x, axis) for x in xs), xs)

  run = jax.jit(jax.shard_map(rounds, mesh=strategy.mesh, in_specs=P(axis),
                              out_specs=P(axis), check_vma=False))
  buffers = placement.put_per_replica(
      tuple(np.zeros((n, max(size // 4, 1)), np.float32) for size in sizes),
      strategy.mesh, axis, n)
  _block(run(*buffers))
  start = time.perf_counter()
  _block(run(*buffers))
  return (time.perf_counter() - start) / k


def _conclude(one: StepTimes, many: StepTimes, run: _Run,
              strategy) -> Diagnosis:
  n, global_batch = many.num_replicas, run.global_batch
  ms = lambda x: f"{1e3 * x:.2f} ms"  # noqa: E731
  parts = {p: getattr(many, p) for p in _PARTS}
  worst = max(parts, key=parts.get)
  share = f"{100 * parts[worst] / many.step:.0f}% of the step"
  if many.recompilations:
    bottleneck = "recompilation"
    cause = (f"the step compiled {many.recompilations} more times while the "
             "loop ran (each compilation takes "
             f"{ms(many.compile_seconds)}): the batches change shape, dtype "
             "or structure.")
    fix = ("Keep batch shapes fixed: pad to a fixed size (distributed "
           "datasets pad a short last batch for you) and pass numbers as "
           "arrays, not static arguments.")
  elif worst == "input_wait":
    bottleneck = "input"
    cause = (f"the devices wait {ms(many.input_wait)} for each batch "
             f"({share}): reading, preparing and copying the batches is "
             "slower than the step.")
    fix = ("Prepare batches ahead of the loop and in parallel (tf.data or "
           "grain with prefetch and workers), cache decoded data in memory, "
           "or do more work per batch (a larger batch).")
  elif worst == "collectives":
    bottleneck = "collectives"
    cause = (f"the all-reduce of {many.collective_bytes:,} bytes a step takes "
             f"{ms(many.collectives)} ({share}), more than computing on "
             f"{global_batch // n} examples per replica.")
    fix = ("Raise the batch per replica (compute grows with it, the "
           "all-reduce does not), or accumulate gradients over several "
           "batches before reducing them.")
  elif worst == "overhead":
    bottleneck = "overhead"
    cause = (f"a step computes for {ms(many.compute + many.collectives)} but "
             f"launching it and waiting for it take {ms(many.overhead)} "
             f"({share}): the model is too small for {n} devices.")
    fix = ("Raise the batch, or run several steps per dispatch "
           "(steps_per_execution: jdist.Trainer(..., steps_per_execution=K)).")
  elif one.compute >= 0.75 * n * many.compute:
    bottleneck = "compute"
    cause = (f"the computation itself ({share}), "
             f"{one.compute / many.compute:.1f}x faster than on one device: "
             "the time goes where it should.")
    fix = ("Nothing in the loop to fix; for more speed use more devices, "
           "mixed precision, or a cheaper model.")
  else:
    bottleneck = "compute"
    cause = (f"the computation ({share}) takes {ms(many.compute)} on "
             f"{global_batch // n} examples per replica against "
             f"{ms(one.compute)} for all {global_batch} on one device: "
             f"{one.compute / many.compute:.1f}x faster, not {n}x.")
    if strategy.devices[0].platform == "cpu":
      fix = ("CPU devices share the host's cores (see the note): expect "
             "little more from more of them here. On GPUs or TPUs, give each "
             "replica enough examples to keep its device busy.")
    else:
      fix = ("Give each replica enough work to keep its device busy: raise "
             "the global batch with the replicas (per-replica batch x "
             "num_replicas_in_sync).")
  notes = list(run.notes)
  if one.step < many.step:
    notes.append(f"{n} devices are slower than one "
                 f"({many.samples_per_second:,.0f} against "
                 f"{one.samples_per_second:,.0f} samples/s).")
  if strategy.devices[0].platform == "cpu":
    notes.append(f"{n} CPU devices share this host's {os.cpu_count()} cores, "
                 "and one device alone already uses several for large "
                 f"operations: on CPU, {n} devices cannot compute {n} times "
                 "as fast. GPUs and TPUs each have their own.")
  if many.host_callbacks:
    notes.append(f"The step calls back to Python {many.host_callbacks} times "
                 "(jax.debug.print, pure_callback, io_callback): each one "
                 "stops the devices until the host answers. Remove them from "
                 "the training step.")
  return Diagnosis(single=one, multi=many, global_batch=global_batch,
                   steps=run.steps, bottleneck=bottleneck, cause=cause, fix=fix,
                   notes=tuple(notes))
