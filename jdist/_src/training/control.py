"""Callbacks that steer training: LearningRateScheduler, EarlyStopping and
ReduceLROnPlateau."""

from __future__ import annotations

import inspect
import warnings
from typing import Callable

import numpy as np

from jdist._src.core import placement
from jdist._src.training.callbacks import Callback, is_chief, resolve_mode


class LearningRateScheduler(Callback):
  """Sets the learning rate at the start of every epoch, as Keras does.

  The optimizer must keep its learning rate in its state:
  `optax.inject_hyperparams(optax.adam)(learning_rate=...)`.

  Args:
    schedule: `schedule(epoch, lr) -> new_lr` (or `schedule(epoch)`).
    verbose: 1 prints the new rate (process 0 only).

  Example:
    >>> import jdist
    >>> cb = jdist.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
  """

  def __init__(self, schedule: Callable, verbose: int = 0):
    super().__init__()
    self.schedule = schedule
    self.verbose = verbose
    try:
      self._takes_lr = len(inspect.signature(schedule).parameters) >= 2
    except (TypeError, ValueError):
      self._takes_lr = True

  def on_train_begin(self, logs=None):
    self.model.learning_rate  # fails early, with the fix, if not injectable

  def on_epoch_begin(self, epoch, logs=None):
    lr = self.model.learning_rate
    new = self.schedule(epoch, lr) if self._takes_lr else self.schedule(epoch)
    new = float(new)
    if not np.isfinite(new):
      raise ValueError(f"The schedule returned a learning rate of {new} for "
                       f"epoch {epoch}.")
    self.model.learning_rate = new
    if self.verbose and is_chief():
      print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning "
            f"rate to {new:.6g}.")

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      logs["learning_rate"] = self.model.learning_rate


class EarlyStopping(Callback):
  """Stops training when a monitored value stops improving (Keras' semantics).

  Args:
    monitor: the log to watch, such as "val_loss" or "accuracy".
    min_delta: smallest change that counts as an improvement.
    patience: epochs without improvement before stopping.
    mode: "min", "max", or "auto" (max for names with "acc", else min).
    baseline: stop unless the value beats this within `patience` epochs.
    restore_best_weights: put back the parameters of the best epoch when
      training stops.
    start_from_epoch: epochs to wait before monitoring.
    verbose: 1 prints when it stops.

  Attributes:
    stopped_epoch: the epoch training stopped at (0 if it did not stop).
    best: the best value seen.

  Example:
    >>> import jdist
    >>> cb = jdist.EarlyStopping(monitor="val_loss", patience=2)
  """

  def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0,
               patience: int = 0, mode: str = "auto", baseline=None,
               restore_best_weights: bool = False, start_from_epoch: int = 0,
               verbose: int = 0):
    super().__init__()
    self.monitor, self.mode = monitor, resolve_mode(mode, monitor)
    self.min_delta = abs(min_delta)
    self.patience, self.baseline = patience, baseline
    self.restore_best_weights = restore_best_weights
    self.start_from_epoch, self.verbose = start_from_epoch, verbose

  def on_train_begin(self, logs=None):
    self.wait = 0
    self.stopped_epoch = 0
    self.best = np.inf if self.mode == "min" else -np.inf
    self.best_state = None
    self.best_epoch = 0

  def _improved(self, value, reference) -> bool:
    if self.mode == "min":
      return value < reference - self.min_delta
    return value > reference + self.min_delta

  def on_epoch_end(self, epoch, logs=None):
    value = (logs or {}).get(self.monitor)
    if value is None:
      warnings.warn(
          f"EarlyStopping watches {self.monitor!r}, which is not in the logs "
          f"({sorted(logs or {})}); it does nothing.", UserWarning)
      return
    if epoch < self.start_from_epoch:
      return
    if self.restore_best_weights and self.best_state is None:
      self.best_state = self._copy_state()
    self.wait += 1
    if self._improved(value, self.best):
      self.best, self.best_epoch = value, epoch
      if self.restore_best_weights:
        self.best_state = self._copy_state()
      if self.baseline is None or self._improved(value, self.baseline):
        self.wait = 0
      return
    if self.wait >= self.patience and epoch > 0:
      self.stopped_epoch = epoch
      self.model.stop_training = True
      if self.restore_best_weights and self.best_state is not None:
        placement = self.model.strategy.state_placement
        self.model.state = placement.write(
            self.model.state, placement.read(self.model.state).replace(
                params=self.best_state.params,
                model_state=self.best_state.model_state),
            self.model.strategy.mesh)
        if self.verbose and is_chief():
          print(f"Restoring the parameters of epoch {self.best_epoch + 1}.")

  def _copy_state(self):
    """The trainer's state, copied: fit's next step donates its arrays."""
    return placement.copy_arrays(
        self.model.strategy.state_placement.read(self.model.state))

  def on_train_end(self, logs=None):
    if self.stopped_epoch > 0 and self.verbose and is_chief():
      print(f"Epoch {self.stopped_epoch + 1}: early stopping")


class ReduceLROnPlateau(Callback):
  """Lowers the learning rate when a monitored value stops improving (Keras').

  After `patience` epochs without improvement the rate becomes
  `max(rate * factor, min_lr)`. The optimizer must keep its learning rate
  in its state (`optax.inject_hyperparams`); the logs get "learning_rate".

  Args:
    monitor: the log to watch, such as "val_loss".
    factor: what the rate is multiplied by (below 1).
    patience: epochs without improvement before lowering it.
    verbose: 1 prints each change (process 0 only).
    mode: "min", "max", or "auto" (max for names with "acc", else min).
    min_delta: the smallest change that counts as an improvement.
    cooldown: epochs to wait after a change before counting again.
    min_lr: the lowest rate it sets.

  Raises:
    ValueError: a factor of 1 or more.

  Example:
    >>> import jdist
    >>> cb = jdist.ReduceLROnPlateau(monitor="val_loss", factor=0.5,
    ...                              patience=2, min_lr=1e-5)
  """

  def __init__(self, monitor: str = "val_loss", factor: float = 0.1,
               patience: int = 10, verbose: int = 0, mode: str = "auto",
               min_delta: float = 1e-4, cooldown: int = 0,
               min_lr: float = 0.0):
    super().__init__()
    if factor >= 1.0:
      raise ValueError("ReduceLROnPlateau does not support a factor >= 1.0 "
                       f"(it lowers the rate), got {factor}.")
    self.monitor, self.mode = monitor, resolve_mode(mode, monitor)
    self.factor, self.patience, self.verbose = factor, patience, verbose
    self.min_delta, self.cooldown, self.min_lr = min_delta, cooldown, min_lr

  def on_train_begin(self, logs=None):
    self.model.learning_rate  # fails early, with the fix, if not held
    self.best = np.inf if self.mode == "min" else -np.inf
    self.wait = 0
    self.cooldown_counter = 0

  def _improved(self, value) -> bool:
    if self.mode == "min":
      return value < self.best - self.min_delta
    return value > self.best + self.min_delta

  def on_epoch_end(self, epoch, logs=None):
    logs = logs if logs is not None else {}
    logs["learning_rate"] = self.model.learning_rate
    value = logs.get(self.monitor)
    if value is None:
      warnings.warn(
          f"ReduceLROnPlateau watches {self.monitor!r}, which is not in the "
          f"logs ({sorted(logs)}); it does nothing.", UserWarning)
      return
    if self.cooldown_counter > 0:
      self.cooldown_counter -= 1
      self.wait = 0
    if self._improved(value):
      self.best, self.wait = value, 0
    elif self.cooldown_counter <= 0:
      self.wait += 1
      if self.wait >= self.patience:
        self._lower(epoch)

  def _lower(self, epoch: int) -> None:
    old = self.model.learning_rate
    if old <= np.float32(self.min_lr):
      return
    new = max(old * self.factor, self.min_lr)
    self.model.learning_rate = new
    if self.verbose and is_chief():
      print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate "
            f"to {new:.6g}.")
    self.cooldown_counter, self.wait = self.cooldown, 0
