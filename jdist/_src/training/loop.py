"""The batch loops of `fit`, `evaluate` and `predict`, and the state of a fit.

`FitLoop` owns a Trainer's loop state, between fits too (train state, step
count, position, `stop_training`, totals, History); callbacks reach it as
`callback.fit_loop`, and checkpoints store it. A `fit` is one `run` of a
`FitPlan`.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jdist._src.core import placement
from jdist._src.input.options import InputOptions
from jdist._src.training import epochs as epochs_lib
from jdist._src.training import shuffle_order
from jdist._src.training import totals as totals_lib
from jdist._src.training.callbacks import CallbackList, LazyLogs
from jdist._src.training.history import History
from jdist._src.training.progress import ProgressBar


class Position(NamedTuple):
  """Where training is: epoch, batch within it, batches taken from the data
  (a named tuple: fit makes one per step, and a tuple is cheapest)."""

  epoch: int = 0
  batch: int = 0
  consumed: int = 0

  def next_batch(self, steps: int = 1) -> "Position":
    return Position(self.epoch, self.batch + steps, self.consumed + steps)

  def next_epoch(self) -> "Position":
    return Position(self.epoch + 1, 0, self.consumed)


class FitPlan(NamedTuple):
  """What one `fit` runs (the state, position and history are the loop's).

  Attributes:
    train_function: the compiled `(state, totals, batch) -> (state, totals)`.
    source: the training data, a `source.Source`.
    epochs: train until this epoch.
    make_totals: `make_totals(sums or None) -> totals`, placed.
    read_logs: `read_logs(state) -> read(totals) -> logs`; it keeps what the
      logs need of `state` (the next step may donate it).
    initial_epoch: the epoch to start at.
    validate: `validate(state, callbacks) -> logs`, or None.
    batch_size: the static global batch size (None: the dataset decides).
    options: the `InputOptions` the batches are distributed with.
    steps_per_execution: batches per call of `train_function`.
    batches_per_step: batches per optimizer step (accumulation).
    skipped: a `mixed_precision.SkippedBatches` under a loss scale, or None.
  """

  train_function: Any
  source: Any
  epochs: int
  make_totals: Callable
  read_logs: Callable
  initial_epoch: int = 0
  validate: Callable | None = None
  batch_size: int | None = None
  options: InputOptions | None = None
  steps_per_execution: int = 1
  batches_per_step: int = 1
  skipped: Any = None


class FitLoop:
  """A `Trainer`'s training loop and everything it carries, fits or not.

  The trainer's `state`, `stop_training`, `global_step` and `position` are
  the loop's; the loop never sees the trainer.

  Args:
    strategy: the strategy the steps run on; may be given later, before
      any state.

  Attributes:
    strategy: that strategy.
    position: the epoch and batch training is at (between fits, where the
      last one ended).
    stop_training: ends training after the current batch; False at each
      fit's start.
    source: the data of the running (or last) fit.
    steps_per_execution: batches per call of the train function.
    batches_per_step: batches per optimizer step.
    last_execution: batches the last call of the train function ran.
    totals: the epoch's running sums on the devices (`jdist.metrics`).
    history: the last fit's `History` (None before the first).
  """

  def __init__(self, strategy=None):
    self.strategy = strategy
    self.history: History | None = None
    self.position = Position()
    self.stop_training = False
    self.source = None
    self.steps_per_execution = 1
    self.batches_per_step = 1
    self.last_execution = 1
    self.totals = None
    self._plan: FitPlan | None = None
    self._resume_sums = None
    self._warned_nonfinite = False
    self._state = None
    self._step = 0

  @property
  def state(self):
    """The train state, held as the strategy holds it."""
    return self._state

  @state.setter
  def state(self, held) -> None:
    """Replaces the train state; the step count follows it."""
    self._state = held
    self._step = 0 if held is None else int(placement.to_host(
        self.strategy.state_placement.read(held).step))

  @property
  def global_step(self) -> int:
    """Optimizer steps applied so far, counted on the host (read from the
    state only when it is given or replaced, or held remotely)."""
    return self._step

  @property
  def batches_trained(self) -> int:
    """Batches trained on since the first step, resumed runs' included."""
    return self._step * self.batches_per_step

  def reached_multiple(self, every: int) -> bool:
    """Whether the last execution made `batches_trained` reach a multiple
    of `every` (as Keras' `save_freq` counts; it may move several at once).
    """
    done, ran = self.batches_trained, self.last_execution
    return done // every > (done - ran) // every

  def logs(self) -> dict:
    """The epoch's logs so far, read from the devices."""
    return self._plan.read_logs(self._state)(self.totals)

  # --- checkpoints ----------------------------------------------------------

  def checkpoint_meta(self) -> dict:
    """JSON metadata saved with a checkpoint: position, history, data state."""
    pos = self.position
    sums = None
    if pos.batch and self.totals is not None:
      sums = totals_lib.read_sums(
          self.strategy, self.strategy.state_placement.read(self.totals))
    return {"epoch": pos.epoch, "batch": pos.batch, "consumed": pos.consumed,
            "sums": sums, "history": self.history.to_dict(),
            "data": self.source.state(pos.consumed)}

  def restore(self, state, meta: dict) -> None:
    """Continues from a restored checkpoint's `state` and `meta`."""
    self.state = self.strategy.state_placement.write(
        self._state, state, self.strategy.mesh)
    self.position = Position(int(meta["epoch"]), int(meta["batch"]),
                             int(meta["consumed"]))
    if self.position.batch % self.batches_per_step:
      raise ValueError(
          f"The checkpoint was saved after batch {self.position.batch} of "
          f"epoch {self.position.epoch + 1}, inside a group of "
          f"gradient_accumulation_steps={self.batches_per_step} batches: it "
          "was written by a run with another gradient_accumulation_steps. "
          "Resume with the value it was saved with.")
    self._resume_sums = meta.get("sums")
    if meta.get("history"):
      self.history.load_dict(meta["history"])
    self.source.resume(meta.get("data") or {}, self.position.consumed)

  # --- the loop -------------------------------------------------------------

  def epoch_length(self, epoch: int) -> int | None:
    """Epoch `epoch`'s batches, when known (`epochs.epoch_span`)."""
    source = self.source
    return epochs_lib.epoch_span(epoch, source.steps_per_epoch,
                                 source.pass_length)[2]

  def run(self, plan: FitPlan, cbs: CallbackList, bar: ProgressBar
          ) -> History:
    """Trains as `plan` says, until its last epoch or a callback stops it;
    returns the fit's `History`.

    The steps that ran stay applied when an exception ends the fit, as
    Keras' variables do. The epochs run here, not in a function of their
    own, so a callback's error shows a traceback a frame shorter.
    """
    self._start(plan)
    try:
      plan, logs = self._plan, {}
      cbs.call("on_train_begin", {})
      while self.position.epoch < plan.epochs:
        epoch, start = self.position.epoch, self.position.batch
        self.totals = plan.make_totals(self._resume_sums if start else None)
        self._resume_sums = None
        cbs.call("on_epoch_begin", epoch, {})
        bar.start_epoch(epoch, self.epoch_length(epoch), initial=start)
        if plan.skipped is not None:
          plan.skipped.start_epoch(self._state)
        started = time.perf_counter()
        ran = self._run_epoch(epoch, start, cbs, bar)
        if not ran and start == 0:
          warnings.warn(
              f"The training data ran out at epoch {epoch + 1}: no batches "
              "were left. Training stops here; pass steps_per_epoch and "
              "enough data (or a re-iterable dataset) for every epoch.",
              UserWarning)
          break
        if bar.times_steps:  # until the epoch's last step is done
          jax.block_until_ready((self._state, self.totals))
          bar.timed(ran, time.perf_counter() - started)
        logs = self.logs()
        if plan.validate is not None:
          val_logs = plan.validate(self._state, cbs)
          logs.update({f"val_{k}": v for k, v in val_logs.items()})
        self.position = self.position.next_epoch()
        self.totals = None
        self.history.on_epoch_end(epoch, logs)  # first: checkpoints see it
        cbs.call("on_epoch_end", epoch, logs)
        bar.end_epoch(epoch, logs)
        self._warn(epoch, logs)
        if self.stop_training:
          break
      cbs.call("on_train_end", logs)
    finally:
      shuffle_order.shutdown()  # the worker drawing permutations ahead
    if not self.strategy.synchronous:
      self.state = self._state  # the step count the servers applied
    return self.history

  def _start(self, plan: FitPlan) -> None:
    """Takes `plan`'s inputs and starts a fit's own records; ValueError for
    an epoch that would end inside an accumulation group."""
    epochs_lib.check_whole_groups(
        plan.source, range(plan.initial_epoch, plan.epochs),
        plan.batches_per_step, plan.steps_per_execution)
    epochs_lib.warn_mid_pass_start(plan.source, plan.initial_epoch,
                                   stacklevel=5)
    if self.strategy.synchronous:
      # The train function donates the state: a copy is trained, so arrays
      # read before fit (`trainer.params`, an nnx module `export` updated)
      # stay valid. Those of `trainer.state` read during fit are valid
      # until the next step (`EarlyStopping` copies what it keeps).
      self._state = placement.copy_arrays(self._state)
    self._plan = plan
    self.source = plan.source
    self.history = History()
    self.position = Position(epoch=plan.initial_epoch)
    self.stop_training = False
    self.steps_per_execution = plan.steps_per_execution
    self.batches_per_step = plan.batches_per_step
    self.last_execution = 1
    self.totals = None
    self._resume_sums = None
    self._warned_nonfinite = False

  def _run_epoch(self, epoch: int, start: int, cbs: CallbackList,
                 bar: ProgressBar) -> int:
    """Trains on the epoch's batches from `start`; the batches that ran.

    Between calls the state and totals stay flat (`_Carry`); they are
    rebuilt only when something reads them per call, when the bar redraws
    (its logs read before the next step donates their state), and at the end.
    """
    plan = self._plan
    batches = self.source.distributed(
        self.strategy, epoch, start, options=plan.options,
        batch_size=plan.batch_size, per_call=self.steps_per_execution)
    hooks = _Hooks(cbs, bar, plan.skipped is not None,
                   grouped=self.steps_per_execution > 1)
    carry = _Carry(plan.train_function)
    held = (self._state, self.totals)
    call = carry.start(*held)
    per_call, draws, ran, drawn = hooks.per_call, hooks.draws, 0, 0
    self.last_execution = 1
    try:
      for batch in batches:
        if per_call:  # the values rebuilt, the callbacks called
          if self._state is not held[0] or self.totals is not held[1]:
            call = carry.start(self._state, self.totals)  # replaced
          steps = self._begin_call(epoch, start + ran, batch, hooks)
          call(batch)
          self._step += steps // self.batches_per_step
          ran += steps
          held = self._state, self.totals = carry.values()
          self._end_call(start + ran - steps, steps, hooks)
          drawn = ran
        else:  # the step and little else
          call(batch)
          self._step += 1
          ran += 1
          if draws and bar.due():
            bar.step(LazyLogs(functools.partial(self._logs_of, carry)),
                     ran - drawn)
            drawn = ran
        if self.stop_training:
          break
    finally:
      if self._state is held[0] and self.totals is held[1]:
        self._state, self.totals = carry.values()  # else a callback's
      if not hooks.per_call:  # (else moved at every call)
        at = self.position
        self.position = Position(at.epoch, at.batch + ran, at.consumed + ran)
        bar.advance(ran - drawn)
    return ran

  def _begin_call(self, epoch: int, index: int, batch,
                  hooks: "_Hooks") -> int:
    """Before a call on `batch` from batch `index`: the accumulation groups'
    rule and `on_train_batch_begin`. Returns the call's batches."""
    steps = batch.num_steps if hooks.grouped else 1
    if steps % self.batches_per_step:
      epochs_lib.check_group_end(epoch, index, steps, self.batches_per_step)
    if hooks.begin:
      hooks.cbs.call("on_train_batch_begin", index, {})
    return steps

  def _end_call(self, index: int, steps: int, hooks: "_Hooks") -> None:
    """After a call of `steps` batches from batch `index`: skipped steps,
    the position, `on_train_batch_end` and the bar."""
    plan = self._plan
    if plan.skipped is not None:
      plan.skipped.record(self._state, index, steps)
    self.last_execution = steps
    self.position = self.position.next_batch(steps)
    logs = None
    if hooks.logged:
      logs = LazyLogs(functools.partial(plan.read_logs(self._state),
                                        self.totals))
      if hooks.end:
        hooks.cbs.call("on_train_batch_end", index + steps - 1, logs)
    hooks.bar.step(logs, steps)

  def _logs_of(self, carry: "_Carry") -> dict:
    """The logs of the step that just ran (read before the next one)."""
    state, totals = carry.values()
    return self._plan.read_logs(state)(totals)

  def _warn(self, epoch: int, logs: dict) -> None:
    """The epoch's warnings: steps skipped at the scale's floor, a NaN loss."""
    skipped = self._plan.skipped
    message = None if skipped is None else skipped.end_epoch(epoch)
    if message is not None:
      warnings.warn(message, UserWarning, stacklevel=4)
    # The epoch's logs are on the host already: telling costs nothing.
    loss = logs.get("loss")
    if loss is None or np.isfinite(loss) or self.stop_training or \
        self._warned_nonfinite:
      return
    self._warned_nonfinite = True
    warnings.warn(
        f"The training loss of epoch {epoch + 1} is {loss}; fit does not stop "
        "for it. Add jdist.TerminateOnNaN() to the callbacks to stop at the "
        "first batch with a NaN loss (checkpoints of a NaN state are never "
        "written).",
        UserWarning, stacklevel=4)


class _Hooks:
  """What runs around each call of the train function in an epoch.

  Attributes:
    cbs, bar: the callbacks and the progress bar.
    begin, end: a callback overrides `on_train_batch_begin` / `_end`.
    grouped: a call takes several batches (a `BatchGroup`).
    logged: each call's logs are made.
    draws: the bar shows logs (it reads them when it redraws).
    per_call: the state, totals or position are needed after every call.
  """

  def __init__(self, cbs: CallbackList, bar: ProgressBar, skipped: bool, *,
               grouped: bool):
    self.cbs, self.bar = cbs, bar
    self.begin = cbs.overrides("on_train_batch_begin")
    self.end = cbs.overrides("on_train_batch_end")
    self.grouped = grouped
    self.per_call = self.begin or self.end or grouped or skipped
    self.draws = bar.reads_logs
    self.logged = self.end or self.draws


class _Carry:
  """The loop's state and totals between calls, as the train function's
  `carry` holds them (`core/carried.py`)."""

  def __init__(self, train):
    self._train = train
    self._carried = None

  def start(self, state, totals) -> Callable:
    """Holds `(state, totals)`; returns `call(batch)`, which runs one call
    on them and keeps its result in their place."""
    self._carried = self._train.carry(state, totals)
    return functools.partial(self._train.call_carried, self._carried)

  def values(self) -> tuple:
    """`(state, totals)` as the last call returned them."""
    return self._carried.values()


def evaluate(test_function, state, batches, totals, read: Callable,
             cbs: CallbackList, bar: ProgressBar, total: int | None) -> dict:
  """Accumulates loss and metrics over `batches`; returns their exact means."""
  cbs.call("on_test_begin", {})
  bar.start_epoch(0, total)
  # Per-batch logs are made for a callback that reads them, or for the bar
  # when it redraws (read at once: the next batch may donate the totals).
  logged = cbs.overrides("on_test_batch_end")
  try:
    ran = drawn = 0
    for i, batch in enumerate(batches):
      cbs.call("on_test_batch_begin", i, {})
      totals = test_function(state, totals, batch)
      ran += 1
      due = bar.due()
      if logged or due:
        logs = LazyLogs(functools.partial(read, totals))
        cbs.call("on_test_batch_end", i, logs)
        if due:
          bar.step(logs, ran - drawn)
          drawn = ran
    bar.advance(ran - drawn)
    if not ran:
      raise ValueError(
          "The evaluation data gave no batches (a one-shot iterator used up "
          "by an earlier evaluation?). Pass arrays or a re-iterable dataset, "
          "or an iterator with enough batches and validation_steps.")
    logs = read(totals)
    bar.end_epoch(0, logs)
  finally:
    bar.close()
  cbs.call("on_test_end", logs)
  return logs


def predict(predict_function, state, batches, strategy, cbs: CallbackList,
            bar: ProgressBar, total: int | None) -> Any:
  """Runs `predict_function` over `batches`; host outputs without padding rows."""
  outputs = []
  cbs.call("on_predict_begin", {})
  bar.start_epoch(0, total)
  try:
    for i, batch in enumerate(batches):
      cbs.call("on_predict_batch_begin", i, {})
      outputs.append(predict_function(state, batch))
      cbs.call("on_predict_batch_end", i, {"outputs": outputs[-1]})
      bar.step({})
    bar.end_epoch(0, {})
  finally:
    bar.close()
  cbs.call("on_predict_end", {})
  # Gathering after the loop keeps the host from waiting on every batch.
  gathered = [placement.to_host(strategy.gather(o)) for o in outputs]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *gathered)
