"""TerminateOnNaN: stop training when the loss becomes NaN or infinite."""

from __future__ import annotations

import numpy as np

from jdist._src.core import placement
from jdist._src.training import totals as totals_lib
from jdist._src.training.callbacks import Callback, is_chief


class TerminateOnNaN(Callback):
  """Stops training when the loss becomes NaN or infinite (Keras' callback).

  Unlike Keras, it does not wait for each step: it reads the loss one batch
  late, so training stops one batch after the one that made the loss NaN
  (or at the epoch's end). Checkpoints never hold a non-finite state.

  Example:
    >>> import jdist
    >>> cb = jdist.TerminateOnNaN()
  """

  def __init__(self):
    super().__init__()
    self._pending = None  # (batch, the running loss sum on its way to the host)

  def on_train_begin(self, logs=None):
    self._pending = None

  def on_epoch_begin(self, epoch, logs=None):
    self._pending = None  # the totals start again at zero

  def on_train_batch_end(self, batch, logs=None):
    if self._pending is not None:
      seen, loss = self._pending
      self._check(f"Batch {seen}", float(np.sum(np.asarray(loss))))
    strategy = self.model.strategy
    totals = strategy.state_placement.read(self.fit_loop.totals)
    loss = totals["loss"].totals.value["total"]
    if not loss.is_fully_addressable:  # sum over processes: all see the same
      loss = placement.host_local(totals_lib.device_sums(
          strategy, totals)["loss"]["total"])
    loss.copy_to_host_async()
    self._pending = (batch, loss)

  def on_epoch_end(self, epoch, logs=None):
    self._pending = None
    loss = (logs or {}).get("loss")
    if loss is not None:
      self._check(f"Epoch {epoch + 1}", float(loss))

  def _check(self, where: str, loss: float) -> None:
    if np.isfinite(loss) or self.model.stop_training:
      return
    self.model.stop_training = True
    if is_chief():
      print(f"{where}: Invalid loss, terminating training (the epoch's loss "
            f"is {loss}).", flush=True)
