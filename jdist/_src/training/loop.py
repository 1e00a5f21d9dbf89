"""The batch loops of evaluation and prediction, and resuming inside an epoch."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np

from jdist._src.training.callbacks import CallbackList, LazyLogs
from jdist._src.training.progress import ProgressBar


@dataclasses.dataclass(frozen=True)
class Position:
  """Where training is: epoch, batch within it, batches taken from the data."""

  epoch: int = 0
  batch: int = 0
  consumed: int = 0

  def next_batch(self) -> "Position":
    return Position(self.epoch, self.batch + 1, self.consumed + 1)

  def next_epoch(self) -> "Position":
    return Position(self.epoch + 1, 0, self.consumed)


def epoch_batches(distribute: Callable, source, epoch: int, start: int,
                  first: dict):
  """The epoch's distributed batches from batch `start` on.

  The global batch size is that of the data's first batch, declared up front,
  so a resumed epoch that starts at its short last batch is padded to it and
  the step does not recompile.
  """
  size = int(np.shape(jax.tree.leaves(first)[0])[0])
  return iter(distribute(source.batches(epoch, start), global_batch_size=size))


def evaluate(eval_step, state, batches, totals, read: Callable,
             cbs: CallbackList, bar: ProgressBar, total: int | None) -> dict:
  """Accumulates loss and metrics over `batches`; returns their exact means."""
  cbs.call("on_test_begin", {})
  bar.start_epoch(0, total)
  try:
    ran = 0
    for i, batch in enumerate(batches):
      cbs.call("on_test_batch_begin", i, {})
      totals = eval_step(state, totals, batch)
      logs = LazyLogs(functools.partial(read, totals))
      cbs.call("on_test_batch_end", i, logs)
      bar.step(logs)
      ran += 1
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


def predict(predict_step, state, batches, strategy, cbs: CallbackList,
            bar: ProgressBar, total: int | None):
  """Runs `predict_step` over `batches`; host outputs without padding rows."""
  outputs = []
  cbs.call("on_predict_begin", {})
  bar.start_epoch(0, total)
  try:
    for i, batch in enumerate(batches):
      cbs.call("on_predict_batch_begin", i, {})
      outputs.append(predict_step(state, batch))
      cbs.call("on_predict_batch_end", i, {"outputs": outputs[-1]})
      bar.step({})
    bar.end_epoch(0, {})
  finally:
    bar.close()
  cbs.call("on_predict_end", {})
  # Gathering after the loop keeps the host from waiting on every batch.
  gathered = [strategy.gather(o) for o in outputs]
  return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                      *gathered)
