"""A `TrainingProgram`'s steps compiled by a strategy, as Keras names them,
and the train step planned before fit's first step.

`train_function`, `test_function` and `predict_function` are the program's
per-replica steps given to `strategy.function`, each made once. What differs
between strategies is what the strategy declares (`StrategyBase.synchronous`),
never its type: a synchronous strategy runs several batches per call
(`steps_per_execution`, gradient accumulation: a `MultiStepFunction`) and
the train function donates the state it is given; the parameter-server
engine schedules one step per call on a worker and donates nothing.

`TrainPlanner` is `jdist.plan` for the program `fit` runs: it lowers the
train function's own carried program (`DistributedFunction.carry`, the one
fit's loop calls) for the state, the running totals and fit's first batch
(its first group, with `steps_per_execution`), so compiling it for the plan
compiles what the first step runs: nothing compiles twice. Before the
trainer is built, the state is planned from its shapes (`jax.eval_shape` of
the program's init), laid out as the strategy will build it, after the
checks of the data that need no values (the model takes the inputs, the
loss and metrics take its outputs and the targets): a step that would not
fit the devices' memory is refused before its state is built. Under a
strategy that runs steps apart (parameter servers) or data that its
pipelines batch (`DatasetCreator`: `Source.whole_calls`), nothing is
planned.
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
from jdist._src.strategies.spmd import Strategy
from jdist._src.training import steps
from jdist._src.training import totals as totals_lib
from jdist._src.training.program import TrainingProgram, check_count


def batches_per_call(program: TrainingProgram, steps_per_execution: int, *,
                     shard_optimizer_state: bool) -> int:
  """Batches each call of the train function runs: `steps_per_execution`,
  or one accumulation group when that is 1. Checks the Trainer's options
  that concern compiling, before anything is built.

  Raises:
    TypeError, ValueError: `steps_per_execution` is not a positive whole
      number or would split an accumulation group, or the optimizer state
      would be sharded under loss scaling.
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
  """The compiled steps of `program` on `strategy`, each made on first use.

  Args:
    program: the `TrainingProgram`.
    strategy: the strategy that compiles and runs the steps.
    shard_optimizer_state: the train step applies the program's optimizer
      as a `ShardedOptimizer` over the strategy's replicas (ZeRO).
    batches_per_call: batches each call of the train function takes
      (`batches_per_call`); above one, the call takes a `BatchGroup`.

  Attributes:
    program: the program the steps run (its optimizer sharded if asked).
    given: the program as given (its optimizer as the user's).
    strategy: the strategy.
  """

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
    """The train function: `(state, totals, batch) -> (state, totals)`, both
    written back where the strategy holds them; made once (again with
    `force`).

    Raises:
      ValueError: several batches per call under a strategy that runs one
        step per call (parameter servers).
    """
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
    """The evaluation function: `(state, totals, batch) -> totals` (the
    model's state is only read); made once (again with `force`)."""
    if self._test is None or force:
      self._test = self.strategy.function(
          self.program.test_step,
          state_output=(None, state_output.whole))
    return self._test

  def predict(self, force: bool = False):
    """The prediction function: `(state, batch) -> predictions`; made once
    (again with `force`)."""
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
  """Plans one Trainer's train step (see the module docstring).

  Attributes:
    functions: the trainer's `StepFunctions` (program, strategy, train
      function).
    checks: its `DataChecks`.
    seed: its seed (the keys its state is initialised from).
    options: the `InputOptions` its batches are distributed with.
    batches_per_call: batches each call of the train function runs.
    shard_optimizer_state: its optimizer state is split over the replicas.
    memory_budget: bytes a device may use, or None (the device's limit).
    count_flops: the model's `train_flops(x)`, or None.
    detail: read the program's collectives and dtype (`trainer.plan`);
      fit's own plan reads only what its check and its logs need.
    cache: the trainer's plans by what they depend on (the state's and
      the first batch's shapes, dtypes and layouts): a fit of the same
      step on the same data plans nothing again.
  """

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
    """`(plan, totals)` of the train step on `source`'s first batch, from
    the held `state` or, when it is None, from the state's shapes; the
    totals made if `totals` is None. Over the memory limit, the plan holds
    its alternatives' plans (`plan.check()` names them).

    Args:
      limited: plan only if a memory limit is known (else `(None,
        totals)`): fit's check before it builds the state.

    Raises:
      TypeError, ValueError: the data does not fit the model, loss or
        metrics.
    """
    strategy = self.strategy
    if not (isinstance(strategy, Strategy) and strategy.synchronous) or (
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
    """What fit's first call takes: the first batch distributed (one group
    of `batches_per_call` of them), placed as the loop places it."""
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
