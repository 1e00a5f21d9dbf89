"""Callbacks that write logs: CSVLogger and TensorBoard (process 0 only)."""

from __future__ import annotations

import csv
import os

import jax

from jdist._src.training.callbacks import Callback, is_chief


class CSVLogger(Callback):
  """Writes one row per epoch (`epoch` and every log) to a CSV file, on
  process 0; `append=True` adds to an existing file (a resumed run's).

  Example:
    >>> import jdist
    >>> cb = jdist.CSVLogger("training.csv")
  """

  def __init__(self, filename, separator: str = ",", append: bool = False):
    super().__init__()
    self.filename = os.fspath(filename)
    self.separator = separator
    self.append = append
    self._file = None
    self._writer = None
    self._keys = None

  def on_train_begin(self, logs=None):
    if not is_chief():
      return
    exists = self.append and os.path.exists(self.filename) and \
        os.path.getsize(self.filename) > 0
    if exists:
      with open(self.filename, newline="") as f:
        header = f.readline().strip()
      self._keys = header.split(self.separator)[1:] if header else None
    self._file = open(self.filename, "a" if self.append else "w", newline="")
    if self._keys is not None:
      self._writer = csv.DictWriter(self._file, ["epoch"] + self._keys,
                                    delimiter=self.separator)

  def on_epoch_end(self, epoch, logs=None):
    if self._file is None:
      return
    logs = dict(logs or {})
    if self._writer is None:
      self._keys = sorted(logs)
      self._writer = csv.DictWriter(self._file, ["epoch"] + self._keys,
                                    delimiter=self.separator)
      self._writer.writeheader()
    row = {"epoch": epoch}
    row.update({k: logs.get(k, "NA") for k in self._keys})
    self._writer.writerow(row)
    self._file.flush()

  def on_train_end(self, logs=None):
    self.close()

  def close(self):
    if self._file is not None:
      self._file.close()
      self._file = None
      self._writer = None


class TensorBoard(Callback):
  """Writes scalars for TensorBoard; optionally a jax.profiler trace.

  Logs go to `log_dir/train` and `log_dir/validation` as in Keras; only
  process 0 writes, with tensorboardX.

  Args:
    log_dir: the TensorBoard log directory.
    update_freq: "epoch", or a number of steps between batch-level writes.
    profile_batch: `(start, stop)` steps (1-based, inclusive) to trace with
      `jax.profiler` into `log_dir`, or one step; 0 for no trace.

  Example:
    >>> import jdist
    >>> cb = jdist.TensorBoard("logs", profile_batch=(2, 4))
  """

  def __init__(self, log_dir="logs", update_freq="epoch", profile_batch=0):
    super().__init__()
    self.log_dir = os.fspath(log_dir)
    if update_freq != "epoch" and not (isinstance(update_freq, int) and
                                       update_freq > 0):
      raise ValueError(f"update_freq must be 'epoch' or a positive number of "
                       f"steps, got {update_freq!r}.")
    self.update_freq = update_freq
    if isinstance(profile_batch, int):
      profile_batch = (profile_batch, profile_batch) if profile_batch else None
    if profile_batch is not None:
      start, stop = profile_batch
      if not 0 < start <= stop:
        raise ValueError(f"profile_batch must be (start, stop) with "
                         f"0 < start <= stop, got {profile_batch}.")
    self.profile_batch = profile_batch
    self._writers = {}
    self._steps = 0
    self._tracing = False

  def _writer(self, name: str):
    if name not in self._writers:
      from tensorboardX import SummaryWriter
      self._writers[name] = SummaryWriter(os.path.join(self.log_dir, name))
    return self._writers[name]

  def on_train_begin(self, logs=None):
    self._steps = 0

  def on_train_batch_begin(self, batch, logs=None):
    # With steps_per_execution, one call runs several steps: trace the
    # execution that holds the first step to profile.
    ahead = self.fit_loop.steps_per_execution if self.fit_loop else 1
    if (self.profile_batch and is_chief() and not self._tracing and
        self._steps < self.profile_batch[0] <= self._steps + ahead):
      jax.profiler.start_trace(self.log_dir)
      self._tracing = True

  def on_train_batch_end(self, batch, logs=None):
    ran = self.fit_loop.last_execution if self.fit_loop else 1
    self._steps += ran
    step = self.model.global_step
    if self._tracing and self._steps >= self.profile_batch[1]:
      jax.block_until_ready(self.model.state)
      jax.profiler.stop_trace()
      self._tracing = False
    if (self.update_freq != "epoch" and is_chief() and
        self._steps // self.update_freq > (self._steps - ran) //
        self.update_freq):
      writer = self._writer("train")
      for k, v in (logs or {}).items():
        writer.add_scalar(f"batch_{k}", v, step)

  def on_epoch_end(self, epoch, logs=None):
    if not is_chief():
      return
    for k, v in (logs or {}).items():
      if not isinstance(v, (int, float)):
        continue
      if k.startswith("val_"):
        self._writer("validation").add_scalar(f"epoch_{k[4:]}", v, epoch)
      else:
        self._writer("train").add_scalar(f"epoch_{k}", v, epoch)
    for w in self._writers.values():
      w.flush()

  def on_train_end(self, logs=None):
    self.close()

  def close(self):
    if self._tracing:
      jax.profiler.stop_trace()
      self._tracing = False
    for w in self._writers.values():
      w.close()
    self._writers = {}
