"""Timing a step on one strategy: where each of its seconds goes."""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._src.diagnose import hlo

# Rounds of each loop (fed host batches, and batches already placed).
ROUNDS = 3

# The parts of a step's time, in the order a table shows them.
PARTS = ("input_wait", "compute", "collectives", "dispatch")


@dataclasses.dataclass(frozen=True)
class StepTimes:
  """Where one strategy's step time goes, in seconds per step.

  `input_wait + compute + collectives + dispatch == step`.

  Attributes:
    num_replicas: replicas of the strategy.
    step: a step as the loop runs it, fed host batches.
    input_wait: waiting for the next batch (reading, splitting, copying).
    compute: the step's computation on the devices.
    collectives: the step's all-reduces (and other collectives).
    dispatch: the host launching each step, where the devices do not hide it.
    compile_seconds: compiling the step (its first call, less one step).
    recompilations: compilations after the first, while the loops ran.
    host_callbacks: callbacks to Python compiled into the step.
    collective_bytes: bytes the step's collectives carry, per device.
    samples_per_second: global batch / `step`.
    num_devices: devices the strategy runs on (None: one per replica).
    collectives_by_axes: `((axes, count, bytes), ...)`, largest first.
  """

  num_replicas: int
  step: float
  input_wait: float
  compute: float
  collectives: float
  dispatch: float
  compile_seconds: float
  recompilations: int
  host_callbacks: int
  collective_bytes: int
  samples_per_second: float
  num_devices: int | None = None
  collectives_by_axes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Measured:
  """One strategy's `StepTimes` and what else its run saw."""

  times: StepTimes
  global_batch: int
  steps: int
  notes: tuple[str, ...]


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


def _first_call(step, fn, state, batch) -> float:
  """Seconds for the first (compiling) call; checks what the step returns."""
  start = time.perf_counter()
  result = step(state, batch)
  _block(result)
  seconds = time.perf_counter() - start
  if not (isinstance(result, (tuple, list)) and len(result) == 2):
    raise TypeError(
        f"diagnose runs `state, outputs = step(state, batch)` in a loop, but "
        f"{getattr(fn, '__name__', 'the step')} returned "
        f"{type(result).__name__}. Return (new_state, outputs).")
  return seconds


def measure(strategy, fn, state, batches, steps: int) -> Measured:
  """Times `fn` on `strategy` over the first `steps` batches."""
  def fed():
    return itertools.islice(strategy.experimental_distribute_dataset(batches),
                            steps)

  placed = list(fed())
  if not placed:
    raise ValueError("diagnose got no batches: pass at least one global batch.")
  k = len(placed)
  step = strategy.function(fn)
  initial = strategy.replicate(state)
  first_call = _first_call(step, fn, initial, placed[0])
  compiled = step.num_compilations
  # The two loops take turns, and each keeps its quickest round: a burst of
  # other work on the machine slows one round, not the difference.
  rounds = [(_loop(step, initial, placed), _loop(step, initial, fed()))
            for _ in range(ROUNDS)]
  on_devices = min(placed_s for placed_s, _ in rounds) / k
  as_fed = max(min(fed_s for _, fed_s in rounds) / k, on_devices)
  recompilations = step.num_compilations - compiled
  device, notes = _device_time_or_note(strategy, fn, initial, placed[0], k)
  # Never more than the loop's step: the loop contains the same work.
  device = on_devices if device is None else min(device, on_devices)
  program = step.lower(initial, placed[0]).compile().as_text()
  mesh = strategy.mesh
  by_axes = (hlo.by_mesh_axes(program, mesh.axis_names, mesh.devices.shape)
             if mesh.devices.size > 1 else {})
  by_axes.pop((), None)  # groups of one device: no communication
  collectives = min(_collective_time(mesh, by_axes, k), device)
  leaf = jax.tree.leaves(placed[0].values)[0]  # (replicas, per replica, ...)
  global_batch = leaf.shape[0] * leaf.shape[1]
  times = StepTimes(
      num_replicas=strategy.num_replicas_in_sync, step=as_fed,
      input_wait=as_fed - on_devices, compute=device - collectives,
      collectives=collectives, dispatch=max(on_devices - device, 0.0),
      compile_seconds=max(first_call - on_devices, 0.0),
      recompilations=recompilations,
      host_callbacks=hlo.host_callbacks(program),
      collective_bytes=sum(size for _, size in by_axes.values()),
      samples_per_second=global_batch / as_fed,
      num_devices=int(mesh.devices.size),
      collectives_by_axes=tuple(sorted(
          (("+".join(axes) if axes is not None else "?", count, size)
           for axes, (count, size) in by_axes.items()),
          key=lambda row: -row[2])))
  return Measured(times, global_batch, k, notes)


def _device_time_or_note(strategy, fn, state, batch, k: int):
  """`(seconds per step on the devices, ())`, or `(None, (why not,))`."""
  try:
    return _device_time(strategy, fn, state, batch, k), ()
  except Exception as e:  # noqa: BLE001  (a measurement, not the user's run)
    return None, (f"The step could not run {k} times in one program "
                  f"({type(e).__name__}: {str(e).splitlines()[0][:120]}), so "
                  "dispatch is counted in compute.",)


def _device_time(strategy, fn, state, batch, k: int) -> float:
  """Seconds per step with K steps in one compiled program (no dispatch)."""
  inner = strategy.function(fn)
  # Traced as a loop's body (`in_loop`): on CPU its convolutions are then
  # written in the layout XLA:CPU runs fast in loops too, as in one call.
  many = jax.jit(lambda s, b: jax.lax.fori_loop(
      0, k, lambda i, c: inner.trace_step((c, b), {}, in_loop=True)[0], s))
  _block(many(state, batch))
  start = time.perf_counter()
  _block(many(state, batch))
  return (time.perf_counter() - start) / k


def _collective_time(mesh, by_axes: dict, k: int) -> float:
  """Seconds per step for all-reduces of the step's collective bytes."""
  if not by_axes:
    return 0.0
  names = tuple(mesh.axis_names)
  jobs = [(names if axes is None else axes, size)
          for axes, (_, size) in by_axes.items()]

  def rounds(*xs):
    return jax.lax.fori_loop(0, k, lambda i, xs: tuple(
        jax.lax.psum(x, axes) for x, (axes, _) in zip(xs, jobs)), xs)

  spec = P(names)
  run = jax.jit(jax.shard_map(rounds, mesh=mesh, in_specs=spec,
                              out_specs=spec, check_vma=False))
  n, sharding = mesh.devices.size, jax.sharding.NamedSharding(mesh, spec)
  # Made by each process for its own devices (a mesh may span processes).
  buffers = [jax.make_array_from_callback(
      (n, max(size // 4, 1)), sharding,
      lambda index, size=size: np.zeros((n, max(size // 4, 1)),
                                        np.float32)[index])
             for _, size in jobs]
  _block(run(*buffers))
  start = time.perf_counter()
  _block(run(*buffers))
  return (time.perf_counter() - start) / k
