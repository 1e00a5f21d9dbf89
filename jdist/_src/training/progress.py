"""The progress bar of `fit`: one `tqdm.auto` bar per epoch, on process 0,
reading the logs from the devices at most every `refresh` seconds.
"""

from __future__ import annotations

import sys
import time

from jdist._src.training.callbacks import is_chief

# Seconds between the bar's redraws at most (tqdm's own `mininterval`), and
# between its reads of the logs from the devices.
TICK = 0.1
REFRESH = 0.5


def _fmt(logs) -> dict:
  return {k: f"{v:.4g}" for k, v in logs.items() if isinstance(v, (int, float))}


def resolve_verbose(verbose) -> int:
  """0 (silent), 1 (a bar) or 2 (a line per epoch); "auto" is 1. Non-chief: 0."""
  if verbose == "auto":
    verbose = 1
  if verbose not in (0, 1, 2):
    raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}.")
  return verbose if is_chief() else 0


class ProgressBar:
  """Shows an epoch's steps, steps per second and logs, and at its end the
  FLOP/s and MFU from the train step's `plan`."""

  def __init__(self, verbose, epochs: int, *, refresh: float | None = None,
               plan=None, batches_per_call: int = 1):
    self.verbose = resolve_verbose(verbose)
    self.epochs = epochs
    self.refresh = REFRESH if refresh is None else refresh
    self._bar = None
    self._shown = 0.0
    self._start = 0.0
    self._steps = 0
    self._ticked = 0.0
    self._plan = plan
    self._batches_per_call = batches_per_call
    self._throughput = None

  def start_epoch(self, epoch: int, total: int | None, initial: int = 0):
    self._start, self._steps, self._shown = time.perf_counter(), 0, 0.0
    self._ticked, self._throughput = 0.0, None
    if self.verbose == 1:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, unit="step",
                       desc=f"Epoch {epoch + 1}/{self.epochs}", file=sys.stderr,
                       dynamic_ncols=True, leave=True)

  @property
  def reads_logs(self) -> bool:
    """Whether `step` may read the logs it is given (a bar is drawn)."""
    return self.verbose == 1

  def due(self) -> bool:
    """Whether a drawn bar would redraw now (`TICK` seconds since it last
    took steps)."""
    return self._bar is not None and time.perf_counter() - self._ticked >= TICK

  def step(self, logs, steps: int = 1) -> None:
    """`steps` steps done; `logs` (a lazy mapping) is read only when shown,
    at once (never unless `reads_logs`: then it may be None)."""
    self.advance(steps)
    if self._bar is None:
      return
    now = self._ticked = time.perf_counter()
    if now - self._shown >= self.refresh:
      self._shown = now
      self._bar.set_postfix(_fmt(logs), refresh=False)

  def advance(self, steps: int) -> None:
    """`steps` steps done, their logs shown at the epoch's end."""
    self._steps += steps
    if self._bar is not None and steps:
      self._bar.update(steps)

  @property
  def times_steps(self) -> bool:
    """Whether it shows the throughput (it knows the step's FLOPs): the
    loop then times each epoch's steps (`timed`)."""
    return self._plan is not None

  def timed(self, batches: int, seconds: float) -> None:
    """The epoch's `batches` ran in `seconds` (until the last one's results
    were read back): its throughput, if the step's plan is known."""
    calls = batches / self._batches_per_call
    if self._plan is not None and calls and seconds > 0:
      self._throughput = self._plan.throughput(seconds / calls)

  def end_epoch(self, epoch: int, logs: dict) -> None:
    shown = _fmt(logs)
    if self._throughput is not None:
      shown["throughput"] = str(self._throughput)
    if self._bar is not None:
      self._bar.set_postfix(shown, refresh=False)
      self._bar.close()
      self._bar = None
    elif self.verbose == 2:
      took = time.perf_counter() - self._start
      parts = " - ".join(f"{k}: {v}" for k, v in shown.items())
      print(f"Epoch {epoch + 1}/{self.epochs} - {self._steps} steps - "
            f"{took:.2f}s - {parts}", flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
