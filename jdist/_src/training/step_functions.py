"""A `TrainingProgram`'s steps compiled by a strategy, as Keras names them.

`train_function`, `test_function` and `predict_function` are the program's
per-replica steps given to `strategy.function`, each made once. What differs
between strategies is what the strategy declares (`StrategyBase.synchronous`),
never its type: a synchronous strategy runs several batches per call
(`steps_per_execution`, gradient accumulation: a `MultiStepFunction`) and
the train function donates the state it is given; the parameter-server
engine schedules one step per call on a worker and donates nothing.
"""

from __future__ import annotations

from jdist._src.core import state_output
from jdist._src.core.multi_step import MultiStepFunction
from jdist._src.ops.sharded_optimizer import ShardedOptimizer
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
    strategy: the strategy.
  """

  def __init__(self, program: TrainingProgram, strategy, *,
               shard_optimizer_state: bool = False, batches_per_call: int = 1):
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
