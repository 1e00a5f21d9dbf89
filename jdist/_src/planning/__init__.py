"""`jdist.plan`: a step's per-device memory, FLOPs and layout, from its
compiled program, before it runs."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jdist._src.core.function import DistributedFunction
from jdist._src.planning import alternatives as alternatives_lib
from jdist._src.planning import inputs
from jdist._src.planning import lint
from jdist._src.planning import memory
from jdist._src.planning import peaks
from jdist._src.planning import program
from jdist._src.planning.report import Alternative, Plan
from jdist._src.strategies.mirrored import MirroredStrategy
from jdist._src.strategies.spmd import Strategy

__all__ = ["Alternative", "Plan", "plan"]

# Parameters at least this large (bytes per device) that no layout splits
# are noted under a strategy whose replicas span devices.
WHOLE_ABOVE = 1_000_000
# Arrays the plan lists by name, largest first.
LARGEST = 5


def plan(step: Callable, state: Any, batch: Any, *, strategy=None,
         model_flops: float | None = None, memory_budget=None,
         alternatives: bool = True, whole_above: int = WHOLE_ABOVE) -> Plan:
  """Plans a training step from its compiled program: nothing runs.

  Reads the compiled step's per-device bytes, FLOPs, collectives and
  layout (docs/planning.md); plans other layouts when it does not fit.

  Args:
    step: a `strategy.function` step or a per-replica function
      `step(state, batch) -> (state, outputs)`.
    state: arrays, or `jax.ShapeDtypeStruct` values (`jax.eval_shape`).
    batch: one global batch (arrays or shapes), or a `PerReplica` batch.
    strategy: default: the step's own, else a `MirroredStrategy`.
    model_flops: FLOPs of one step by the model's own count, for MFU.
    memory_budget: bytes a device may use (an int, or "16GB", "512MiB").
    alternatives: plan other layouts when this one does not fit.
    whole_above: bytes per device from which a parameter left whole on
      every device of a model-parallel replica is noted.

  Returns:
    A frozen `jdist.Plan`; `print(plan)` shows the table.

  Raises:
    TypeError: `step` is not callable, or the strategy is not SPMD.
    ValueError: a batch that does not split over the replicas, a bad
      `memory_budget`.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, numpy as np
    >>> def train_step(w, batch):
    ...   loss_fn = lambda w: jdist.compute_average_loss((batch @ w) ** 2)
    ...   loss, g = jax.value_and_grad(loss_fn)(w)
    ...   return w - 0.1 * g, loss
    >>> p = jdist.plan(train_step, jnp.ones(3), np.ones((8, 3), np.float32),
    ...                memory_budget="1MB")
    >>> p.argument("parameters"), p.argument("batch") > 0, p.fits
    (12, True, True)
  """
  fn, strategy, compiled_step = _resolve(step, strategy)
  limit = memory_limit(strategy, inputs.parse_bytes(memory_budget))
  options = dict(model_flops=model_flops, limit=limit,
                 whole_above=whole_above)
  planned = plan_program(compiled_step, strategy, state, batch, **options)
  if planned.fits is not False or not alternatives:
    return planned
  try:
    shapes = inputs.shapes(state)
  except ValueError as e:
    return dataclasses.replace(planned, alternatives=(
        Alternative("other layouts", "-", None, str(e)),))
  rows = inputs.global_batch(batch)
  step_options = _step_options(step)

  def plan_of(candidate):
    other = candidate.strategy
    return plan_program(other.function(fn, **step_options), other, shapes,
                        rows, **options)

  return dataclasses.replace(planned, alternatives=alternatives_lib.evaluate(
      alternatives_lib.fsdp_candidates(strategy), plan_of))


def plan_program(step, strategy, state: Any, batch: Any, *,
                 model_flops: float | None, limit: tuple,
                 whole_above: int = WHOLE_ABOVE) -> Plan:
  """The `Plan` of `step` (a jdist step of `strategy`) for `state` and a
  global or distributed `batch`, under `limit` (`(bytes or None, source)`)."""
  state = inputs.laid_out(strategy, state)
  batch = inputs.distributed_batch(strategy, batch)
  return read_plan(step.lower(state, batch), strategy,
                   memory.state_leaves(state), memory.batch_leaves(batch),
                   model_flops=model_flops, limit=limit,
                   whole_above=whole_above)


def read_plan(lowered, strategy, state_leaves: list, other_leaves: list, *,
              model_flops: float | None, limit: tuple,
              whole_above: int = WHOLE_ABOVE, detail: bool = True) -> Plan:
  """The `Plan` of a `lowered` step, compiling it; without `detail`, the
  program's text is not read."""
  device = strategy.mesh.devices.flat[0]
  facts = program.read(lowered, lowered.compile(), strategy.mesh,
                       detail=detail or peaks.known(device.device_kind))
  leaves = list(state_leaves) + list(other_leaves)
  largest = sorted(leaves, key=lambda l: (-l.device_bytes,
                                          memory.KINDS.index(l.kind)))[:LARGEST]
  return Plan(
      strategy=repr(strategy), platform=device.platform,
      device_kind=device.device_kind, num_devices=int(strategy.mesh.size),
      num_replicas=strategy.num_replicas_in_sync,
      mesh=tuple(dict(strategy.mesh.shape).items()),
      arguments=memory.by_kind(leaves), output_bytes=facts.output_array_bytes,
      alias_bytes=facts.alias_bytes, temp_bytes=facts.temp_bytes,
      program_argument_bytes=facts.argument_bytes,
      program_output_bytes=facts.output_bytes,
      flops_per_device=facts.flops, model_flops=model_flops,
      compute_dtype=facts.compute_dtype,
      peak_flops_per_device=peaks.peak_flops(device.device_kind,
                                             facts.compute_dtype),
      collectives=facts.collectives,
      largest=tuple((l.path, l.kind, l.device_bytes) for l in largest),
      notes=(lint.notes(strategy, state_leaves, whole_above=whole_above)
             if detail else ()),
      memory_limit=limit[0], memory_limit_source=limit[1])


def memory_limit(strategy, budget: int | None) -> tuple:
  """`(bytes a device may use, where that comes from)`, or `(None, "")`."""
  if budget is not None:
    return budget, "memory_budget"
  device = strategy.mesh.devices.flat[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (a backend without memory stats)
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), (
        f"{device.platform}:{device.id} memory_stats()['bytes_limit']")
  return None, ""


def _resolve(step, strategy):
  """`(per-replica function, strategy, the jdist step to compile)`."""
  fn = getattr(step, "python_function", step)
  if not callable(fn):
    raise TypeError(f"plan needs a step function, got {type(step).__name__}:"
                    " pass step(state, batch) -> (state, outputs).")
  own = step.strategy if isinstance(step, DistributedFunction) else None
  strategy = strategy or own or MirroredStrategy(jax.local_devices())
  if not isinstance(strategy, Strategy):
    raise TypeError(
        f"plan compiles one SPMD program over a mesh; {type(strategy).__name__}"
        " runs no such program (its workers run steps apart). Plan the step "
        "under a MirroredStrategy of one worker's devices.")
  if own is not None and own == strategy:
    return fn, strategy, step
  return fn, strategy, strategy.function(fn, **_step_options(step))


def _step_options(step) -> dict:
  """The `Strategy.function` options of a jdist step ({} for a function)."""
  if not isinstance(step, DistributedFunction):
    return {}
  return dataclasses.asdict(step.options)
