"""The running sums of the loss and metrics, and the logs read from them.

Each replica adds its examples into `SyncOnRead` SUM sums on the devices,
read only when shown (no synchronisation per step); an epoch's value is
`total / count`, exact on any number of replicas.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jdist._src.core import placement
from jdist._src.ops import metrics as metrics_lib
from jdist._src.training import mixed_precision


def make_totals(metrics: dict) -> dict:
  """Fresh running sums: the loss's, then `metrics` (`{name: Metric}`)."""
  totals = {"loss": metrics_lib.Mean("loss")}
  totals.update({k: m.reset() for k, m in metrics.items()})
  return totals


def restore_totals(totals: dict, sums: dict) -> dict:
  """`totals` holding `sums` (from `read_sums`, e.g. a checkpoint's)."""
  restored = {}
  for name, metric in totals.items():
    restored[name] = metric.with_sums(
        sums.get(name, {"total": 0.0, "count": 0.0}))
  return restored


def device_sums(strategy, totals: dict) -> dict:
  """`{name: {"total", "count"}}` summed over replicas, on the devices."""
  sync = {k: m.totals for k, m in totals.items()}
  if any(s.per_replica for s in sync.values()):
    return strategy.reduce("sum", sync)
  return {k: s.value for k, s in sync.items()}


def read_sums(strategy, totals: dict) -> dict:
  """`{name: sums}` over replicas on the host in one transfer, as JSON
  values (floats; a Keras metric's variables by name)."""
  sums = placement.to_host(device_sums(strategy, totals))
  return {k: {n: float(a) if np.ndim(a) == 0 else np.asarray(a).tolist()
              for n, a in v.items()} for k, v in sums.items()}


def means(totals: dict, sums: dict) -> dict[str, float]:
  """`{name: value}`: each metric's result from its `read_sums` (the exact
  mean over the examples seen; 0 before any)."""
  return {k: float(totals[k].value_of(v)) for k, v in sums.items()}


class Totals:
  """A Trainer's running sums: fresh ones placed where its strategy holds
  state, and the logs read from held ones. With `scales_loss`, logs add
  the loss scale and the steps skipped."""

  def __init__(self, strategy, metrics: dict, *, scales_loss: bool = False):
    self._strategy = strategy
    self.metrics = metrics
    self._fresh = make_totals(metrics)
    self._scales_loss = scales_loss
    self._placed = None

  def new(self, sums: dict | None = None) -> dict:
    """Fresh running sums (from `sums`, a checkpoint's) where the strategy
    holds them."""
    if not sums and self._placed is not None:
      return self._placed
    totals = self._fresh
    if sums:
      totals = restore_totals(totals, sums)
    placed = self._strategy.replicate(totals)
    if not sums and self._strategy.synchronous:
      self._placed = placed
    return placed

  def means(self, held: dict) -> dict[str, float]:
    """`{name: value}` of held totals, on the host (one read)."""
    totals = self._strategy.state_placement.read(held)
    return means(totals, read_sums(self._strategy, totals))

  def logs_reader(self, state) -> Callable[[dict], dict]:
    """`read(totals) -> logs` for the step that returned `state` (copying
    what it needs: the next step donates `state`)."""
    kept = None
    if self._scales_loss:
      placement_ = self._strategy.state_placement
      if self._strategy.synchronous:
        copied = placement.copy_arrays(
            mixed_precision.train_logs(placement_.read(state).opt_state))
        kept = lambda: copied
      else:
        kept = lambda: mixed_precision.train_logs(
            placement_.read(state).opt_state)

    def read(totals: dict) -> dict:
      logs = self.means(totals)
      if kept is not None:
        logs.update({k: float(v) for k, v in
                     placement.to_host(kept()).items()})
      return logs
    return read

  def skipped_batches(self, batches_per_step: int = 1
                      ) -> mixed_precision.SkippedBatches | None:
    """What tells fit which batches a loss-scaled optimizer skipped; None
    without loss scaling or under an asynchronous strategy."""
    if not self._scales_loss or not self._strategy.synchronous:
      return None
    return mixed_precision.SkippedBatches(
        self._strategy.state_placement.read,
        batches_per_step=batches_per_step)
