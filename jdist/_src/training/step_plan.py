"""A Trainer's train step planned before fit's first step (`jdist.plan` for
the program `fit` runs).

The plan lowers the train function's own carried program
(`DistributedFunction.carry`, the one fit's loop calls) for the state, the
running totals and fit's first batch (its first group, with
`steps_per_execution`), so compiling it for the plan compiles what the
first step runs: nothing compiles twice. Before the trainer is built, the
state is planned from its shapes (`jax.eval_shape` of the program's init),
laid out as the strategy will build it, after the checks of the data that
need no values (the model takes the inputs, the loss and metrics take its
outputs and the targets): a step that would not fit the devices' memory is
refused before its state is built, and a data mistake is still named as
one. Under a strategy that runs steps apart (parameter servers) or data that
its pipelines batch (`DatasetCreator`), nothing is planned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jdist._src import planning
from jdist._src.planning import alternatives as alternatives_lib
from jdist._src.planning import inputs
from jdist._src.planning import memory
from jdist._src.planning.report import Plan
from jdist._src.strategies.spmd import Strategy
from jdist._src.training import data as data_lib
from jdist._src.training import dataset_creator
from jdist._src.training import steps
from jdist._src.training import totals as totals_lib
from jdist._src.training.step_functions import StepFunctions

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
        isinstance(source, dataset_creator.CreatorSource)) or (
            limited and planning.memory_limit(
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
    size = data_lib.static_batch_size(
        source, sample, strategy, WHAT,
        micro_batches=self.functions.program.micro_batches,
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
    lowered = (train.lower(state, totals, batch) if carried is None else
               carried.program.lower(*carried.leaves, batch))
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
    program, strategy = self.functions.program, self.strategy
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
