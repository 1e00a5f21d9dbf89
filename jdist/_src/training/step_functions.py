"""A `TrainingProgram`'s steps compiled by a strategy (`StepFunctions`, as
Keras names them) and the plan of fit's train step (`TrainPlanner`).

A synchronous strategy runs several batches per call and donates the
state; the parameter-server engine runs one step per call. `TrainPlanner`
lowers the train function's own program (the plan compiles what the first
step runs), from the state's shapes, so an oversized step is refused first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jdist._src import planning
from jdist._src.core import state_output
from jdist._src.core.multi_step import MultiStepFunction
from jdist._src.ops.sharded_optimizer import ShardedOptimizer
from jdist._src.planning import alternatives as alternatives_lib
from jdist._src.planning import inputs
from jdist._src.planning import memory
from jdist._src.planning.report import Plan
from jdist._src.training import steps
from jdist._src.training import totals as totals_lib
from jdist._src.training.program import TrainingProgram, check_count


def batches_per_call(program: TrainingProgram, steps_per_execution: int, *,
                     shard_optimizer_state: bool) -> int:
  """Batches each call of the train function runs (`steps_per_execution`,
  or one accumulation group); checks those options (TypeError, ValueError).
  """
  check_count(steps_per_execution, "steps_per_execution", minimum=1)
  if shard_optimizer_state and program.policy.needs_loss_scaling:
    raise ValueError(
        f"shard_optimizer_state=True with dtype_policy="
        f"{program.policy.name!r} is not supported yet: the loss scale "
        "would be hidden inside the sharded optimizer's state. Use "
        "\"mixed_bfloat16\" (no loss scaling), or mirrored optimizer state.")
  accumulation = program.batches_per_step
  if steps_per_execution == 1:
    return accumulation
  if steps_per_execution % accumulation:
    raise ValueError(
        f"steps_per_execution={steps_per_execution} is not a multiple of "
        f"gradient_accumulation_steps={accumulation}: a compiled call runs "
        "whole optimizer steps, each of gradient_accumulation_steps "
        f"batches. Use steps_per_execution=1 (one optimizer step per call) "
        f"or a multiple of {accumulation}.")
  return int(steps_per_execution)


class StepFunctions:
  """The compiled steps of `program` on `strategy`, each made on first use;
  `program` has a `ShardedOptimizer` if `shard_optimizer_state` (`given`:
  as given)."""

  def __init__(self, program: TrainingProgram, strategy, *,
               shard_optimizer_state: bool = False, batches_per_call: int = 1):
    self.given = program
    if shard_optimizer_state:
      program = program.with_optimizer(
          ShardedOptimizer(program.optimizer, strategy))
    self.program = program
    self.strategy = strategy
    self._batches_per_call = batches_per_call
    self._train = self._test = self._predict = None

  def train(self, force: bool = False):
    """`(state, totals, batch) -> (state, totals)`, made once (again with
    `force`); ValueError for several batches per call under an asynchronous
    strategy."""
    if self._train is None or force:
      s = self.strategy
      # The state is donated: one copy of it in memory, not two (fit copies
      # it once first). Totals are not: logs read them after the next step,
      # and the CPU throttle waits on them.
      train = s.function(self.program.train_step, state_output=(0, 1),
                         donate_argnums=(0,))
      if self._batches_per_call > 1:
        if not s.synchronous:
          raise ValueError(
              f"{_several(self.program, self._batches_per_call)} runs "
              "several batches in one compiled call, which needs a "
              "synchronous strategy (Mirrored, MultiWorkerMirrored, TPU, "
              f"OneDevice, CentralStorage); under {type(s).__name__} every "
              "step is scheduled on a worker on its own. Leave it at 1 "
              "there (micro_batches= splits each batch inside its step).")
        train = MultiStepFunction(
            train, batches_per_step=self.program.batches_per_step)
      self._train = train
    return self._train

  def test(self, force: bool = False):
    """`(state, totals, batch) -> totals`, made once (again with `force`)."""
    if self._test is None or force:
      self._test = self.strategy.function(
          self.program.test_step,
          state_output=(None, state_output.whole))
    return self._test

  def predict(self, force: bool = False):
    """`(state, batch) -> predictions`, made once (again with `force`)."""
    if self._predict is None or force:
      self._predict = self.strategy.function(self.program.predict_step,
                                             state_output=None)
    return self._predict


def _several(program: TrainingProgram, batches_per_call: int) -> str:
  """The option that asked for several batches per call, as passed."""
  if program.batches_per_step == 1:
    return f"steps_per_execution={batches_per_call}"
  return f"gradient_accumulation_steps={program.batches_per_step}"


WHAT = "training data"
parse_budget = inputs.parse_bytes


@dataclasses.dataclass(frozen=True)
class TrainPlanner:
  """Plans one Trainer's train step (see the module docstring); `cache`
  keeps the last plan, keyed by the state's and first batch's layouts."""

  functions: StepFunctions
  checks: Any
  seed: int
  options: Any
  batches_per_call: int = 1
  shard_optimizer_state: bool = False
  memory_budget: int | None = None
  count_flops: Callable | None = None
  detail: bool = False
  cache: dict = dataclasses.field(default_factory=dict)

  @property
  def strategy(self):
    return self.functions.strategy

  def plan(self, source, state, totals, *, limited: bool = False
           ) -> tuple[Plan | None, Any]:
    """`(plan, totals)` of the train step on `source`'s first batch (with
    `limited`, only under a known memory limit). TypeError, ValueError if
    the data does not fit the model, loss or metrics."""
    strategy = self.strategy
    if not strategy.synchronous or (
        source.whole_calls) or (limited and planning.memory_limit(
            strategy, self.memory_budget)[0] is None):
      return None, totals
    sample = source.peek()
    if "y" not in sample:  # fit's own check names it
      return None, totals
    if state is None:
      state = self._abstract_state(self.functions, strategy, sample)
    abstract = strategy.state_placement.abstract(state)
    y_pred = self.checks.outputs(sample, abstract, WHAT)
    if totals is None:
      totals = totals_lib.Totals(
          strategy, self.functions.program.metrics_for(sample["y"], y_pred),
          scales_loss=self.functions.program.scales_loss)
    self.checks.shapes(sample, abstract, totals.metrics, WHAT)
    size = source.static_batch_size(
        strategy, WHAT, micro_batches=self.functions.program.micro_batches,
        pad=self.options.pad_to_replicas)
    key = (_layouts(state), steps.spec_key(sample), size, self.detail)
    if key not in self.cache:
      limit = planning.memory_limit(strategy, self.memory_budget)
      planned = self._plan(self.functions, state, totals.new(), sample, size,
                           limit)
      if planned.fits is False:
        planned = dataclasses.replace(planned, alternatives=self._others(
            sample, size, limit))
      self.cache.clear()  # one entry: the data's shapes rarely change
      self.cache[key] = planned
    return self.cache[key], totals

  def _plan(self, functions: StepFunctions, state, totals, sample: dict,
            size: int | None, limit: tuple) -> Plan:
    """The plan of `functions`' train step for these arguments."""
    strategy = functions.strategy
    batch = self._first_batch(strategy, sample, size)
    train = functions.train()
    carried = train.carry(state, totals)
    lowered = (train.lower(state, totals, batch) if carried.leaves is None
               else carried.program.lower(*carried.leaves, batch))
    batch_leaves = memory.batch_leaves(batch)
    other = [dataclasses.replace(l, path=f"totals/{l.path}",
                                 kind=memory.OTHER)
             for l in memory.state_leaves(totals)]
    return planning.read_plan(
        lowered, strategy, memory.state_leaves(state), other + batch_leaves,
        model_flops=self._model_flops(sample, size), limit=limit,
        detail=self.detail)

  def _first_batch(self, strategy, sample: dict, size: int | None):
    """fit's first call's argument: one group of batches, distributed."""
    k = self.batches_per_call
    batches = strategy.experimental_distribute_dataset(
        [sample] * k, self.options, global_batch_size=size)
    return next(iter(batches.group(k) if k > 1 else batches))

  def _model_flops(self, sample: dict, size: int | None) -> float | None:
    """The model's own count for one call (None if it has none)."""
    if self.count_flops is None:
      return None
    rows = size or np.shape(jax.tree.leaves(sample["x"])[0])[0]
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (rows,) + np.shape(a)[1:], a.dtype), sample["x"])
    return float(self.count_flops(x)) * self.batches_per_call

  def _abstract_state(self, functions: StepFunctions, strategy,
                      sample: dict):
    """The state `build` would make, as laid-out shapes (nothing built)."""
    init_key, rng_key = jax.random.split(jax.random.key(self.seed))
    first = jax.tree.map(lambda a: np.asarray(a)[:1], sample["x"])
    program = functions.program
    program.check_init(init_key, first)
    if self.checks.initialised_for is None:
      self.checks.initialised_with(first)
    shapes = jax.eval_shape(program.init, init_key, rng_key, first)
    return inputs.laid_out(strategy, shapes)

  def _others(self, sample: dict, size: int | None, limit: tuple) -> tuple:
    """The alternatives' plans, until one fits: the optimizer state split
    over the replicas (ZeRO), then FSDP over more devices."""
    program, strategy = self.functions.given, self.strategy
    candidates = []
    if (not self.shard_optimizer_state and strategy.num_replicas_in_sync > 1
        and not program.policy.needs_loss_scaling):
      candidates.append(alternatives_lib.Candidate(
          f"the optimizer state split over the {strategy.num_replicas_in_sync}"
          " replicas (ZeRO)", "jdist.Trainer(..., shard_optimizer_state=True)",
          None, StepFunctions(program, strategy, shard_optimizer_state=True,
                              batches_per_call=self.batches_per_call)))
    for c in alternatives_lib.fsdp_candidates(strategy):
      candidates.append(dataclasses.replace(
          c, how=f"jdist.Trainer(..., strategy={c.how})",
          extra=StepFunctions(program, c.strategy,
                              shard_optimizer_state=self.shard_optimizer_state,
                              batches_per_call=self.batches_per_call)))

    def plan_of(candidate):
      functions = candidate.extra
      state = self._abstract_state(functions, functions.strategy, sample)
      fresh = totals_lib.Totals(functions.strategy, program.metrics_for(
          sample["y"], self.checks.outputs(sample, jax.tree.map(
              lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
              WHAT))).new()
      return self._plan(functions, state, fresh, sample, size, limit)

    return alternatives_lib.evaluate(candidates, plan_of)


def _layouts(state) -> tuple:
  """A hashable key of `state`'s structure, shapes, dtypes and layouts."""
  leaves, treedef = jax.tree.flatten(state)
  return treedef, tuple((tuple(np.shape(x)), str(x.dtype),
                         getattr(x, "sharding", None)) for x in leaves)
