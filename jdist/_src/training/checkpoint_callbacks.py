"""Callbacks that write checkpoints: ModelCheckpoint and BackupAndRestore.

Both save the whole train state with the training position as orbax
checkpoints named by the global step; every process takes part in a save.
When `fit` begins, both claim their directory for the job
(`checkpoint/directory_claim.py`), so a directory that cannot be written or
that another running job owns fails before the first step.
"""

from __future__ import annotations

import os
import string
import sys
import warnings

import numpy as np

from jdist._src.training.callbacks import Callback, is_chief, resolve_mode
from jdist._src.checkpoint import manager as manager_lib
from jdist._src.checkpoint.checkpointer import Checkpointer, nonfinite_leaves
from jdist._src.checkpoint.preemption import PreemptionWatcher


def _check_freq(save_freq):
  if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
    raise ValueError(f"save_freq must be 'epoch' or a positive number of "
                     f"batches, got {save_freq!r}.")
  return save_freq


def _save_due(callback: Callback, save_freq) -> bool:
  # Batches are counted, as in Keras. With steps_per_execution or gradient
  # accumulation the count moves by several at a time: as in Keras, the save
  # happens at the end of the execution that reached the count (a group
  # boundary, where training resumes exactly).
  return save_freq != "epoch" and callback.fit_loop.reached_multiple(save_freq)


def _check_directory(path, what: str):
  """`path`, unless it cannot name a directory (ValueError, as TensorFlow)."""
  if path is None or not str(os.fspath(path)).strip():
    raise ValueError(f"{what} needs a directory to write to, got {path!r}.")
  return path


def _save(ckpt: Checkpointer, callback: Callback) -> bool:
  loop = callback.fit_loop
  state = callback.model.strategy.state_placement.read(callback.model.state)
  return ckpt.save(loop.global_step, state,
                   loop.checkpoint_meta())


def _template_fields(path: str) -> list[str]:
  """The names a Keras filepath template fills in ("ckpt_{epoch:02d}")."""
  try:
    return [f for _, f, _, _ in string.Formatter().parse(path) if f is not None]
  except ValueError as e:
    raise ValueError(f"ModelCheckpoint cannot read the path template "
                     f"{path!r}: {e}.") from None


def _check_not_a_keras_file(filepath) -> None:
  path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else ""
  if str(path).endswith((".keras", ".h5")):
    raise ValueError(
        f"ModelCheckpoint(filepath={path!r}): jdist writes each checkpoint as "
        "an orbax directory (sharded arrays, restorable on any device count), "
        "not a Keras .keras or .h5 file. Give a directory name without the "
        "extension, such as 'ckpt_{epoch:02d}'.")


class ModelCheckpoint(Callback):
  """Saves checkpoints during training (load them with `load_checkpoint`).

  Only `filepath` and `monitor` may be positional, as in Keras 3.

  Args:
    filepath: a directory of orbax step directories (not `.keras`/`.h5`);
      as in Keras, a template ("ckpt_{epoch:02d}") makes one per save.
    monitor: the log that decides the best epoch for `save_best_only`.
    verbose: 1 prints each save (process 0 only).
    save_best_only: save at an epoch's end only if `monitor` improved.
    save_weights_only: save the parameters and the model's state without
      the optimizer state, as Keras' weights.
    mode: "min", "max", or "auto" (max for names with "acc", else min).
    save_freq: "epoch", or a number of batches between saves (as Keras
      counts them).
    initial_value_threshold: the `monitor` value a checkpoint must beat
      first, with `save_best_only` (None: any).
    max_to_keep: keep only the newest N checkpoints (None: all).

  Example:
    >>> import jdist
    >>> cb = jdist.ModelCheckpoint("checkpoints", monitor="val_accuracy",
    ...                            save_best_only=True)
    >>> cb = jdist.ModelCheckpoint(filepath="ckpt_{epoch:02d}",
    ...                            save_weights_only=True)
  """

  def __init__(self, filepath, monitor: str = "val_loss", *,
               verbose: int = 0, save_best_only: bool = False,
               save_weights_only: bool = False, mode: str = "auto",
               save_freq="epoch", initial_value_threshold: float | None = None,
               max_to_keep: int | None = None):
    super().__init__()
    _check_not_a_keras_file(filepath)
    self.directory = _check_directory(filepath, "ModelCheckpoint")
    self.monitor = monitor
    self.save_best_only = save_best_only
    self.mode = resolve_mode(mode, monitor)
    self.save_freq = _check_freq(save_freq)
    self.max_to_keep = max_to_keep
    self.verbose = verbose
    self.save_weights_only = bool(save_weights_only)
    self.best = np.inf if self.mode == "min" else -np.inf
    if initial_value_threshold is not None:
      self.best = float(initial_value_threshold)
    self._fields = _template_fields(os.fspath(filepath))
    self._ckpt = None

  def on_train_begin(self, logs=None):
    if not self._fields:
      self._ckpt = Checkpointer(self.directory, max_to_keep=self.max_to_keep,
                                claim=True)
      return
    names = list(self.model.metrics_names)
    known = {"epoch", "batch", *names, *(f"val_{n}" for n in names)}
    unknown = sorted(set(self._fields) - known)
    if unknown:
      raise ValueError(
          f"ModelCheckpoint's path template {os.fspath(self.directory)!r} "
          f"names {unknown}, which no save can fill in. It can use epoch, "
          f"batch and the logs: {sorted(known - {'epoch', 'batch'})}.")
    try:
      os.fspath(self.directory).format(**{k: 1 for k in known})
    except (ValueError, TypeError, IndexError) as e:
      raise ValueError(
          f"ModelCheckpoint's path template {os.fspath(self.directory)!r} "
          f"cannot be filled in: {e}.") from None

  def _write(self, why: str, epoch: int, batch: int | None, logs) -> None:
    ckpt = self._ckpt
    if ckpt is None:  # a template: this save's own directory
      values = dict(logs or {})
      values["epoch"] = epoch + 1
      if batch is not None:
        values["batch"] = batch + 1
      ckpt = Checkpointer(os.fspath(self.directory).format(**values),
                          claim=True)
    try:
      if self.save_weights_only:
        loop = self.fit_loop
        meta = dict(loop.checkpoint_meta(), weights_only=True)
        state = self.model.strategy.state_placement.read(self.model.state)
        saved = ckpt.save(loop.global_step, state.replace(opt_state=()), meta)
      else:
        saved = _save(ckpt, self)
    finally:
      if ckpt is not self._ckpt:
        ckpt.close()
    if saved and self.verbose and is_chief():
      print(f"ModelCheckpoint: saved step {self.model.global_step} to "
            f"{ckpt.directory} ({why}).")

  def on_train_batch_end(self, batch, logs=None):
    if _save_due(self, self.save_freq):
      self._write(f"every {self.save_freq} steps",
                  self.model.position.epoch, batch, logs)

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq != "epoch":
      return
    if not self.save_best_only:
      self._write(f"end of epoch {epoch + 1}", epoch, None, logs)
      return
    value = (logs or {}).get(self.monitor)
    if value is None:
      warnings.warn(
          f"ModelCheckpoint(save_best_only=True) watches {self.monitor!r}, which "
          f"is not in the logs ({sorted(logs or {})}); nothing is saved.",
          UserWarning)
      return
    better = value < self.best if self.mode == "min" else value > self.best
    if better:
      self.best = value
      self._write(f"{self.monitor} improved to {value:.4g}", epoch, None, logs)

  def close(self):
    if self._ckpt is not None:
      self._ckpt.close()
      self._ckpt = None

  def on_train_end(self, logs=None):
    self.close()


class BackupAndRestore(Callback):
  """Survives interruption: backs up training and resumes it exactly.

  When `fit` starts, it restores the newest usable backup (state, data
  position, logs), on any number of devices; on SIGTERM all processes back
  up at one agreed step and exit 0 (docs/fit.md, docs/checkpoints.md).

  Args:
    backup_dir: where backups go (shared by all processes).
    save_freq: "epoch", or a number of batches between backups (as Keras
      counts them).
    delete_checkpoint: delete the backups (and in-memory snapshots) when
      training completes.
    max_to_keep: backups kept; more than one lets a corrupt newest one fall
      back to the one before it.
    snapshot_every: batches between snapshots of the state in host memory
      (a jdist extension, under `jdist launch` only; None: none).

  Raises:
    ValueError: `save_freq` or `snapshot_every` is not a positive number of
      batches, or `snapshot_every` is given outside `jdist launch`.

  Example:
    >>> import jdist
    >>> cb = jdist.BackupAndRestore("/tmp/backup", save_freq=100)

    In a `jdist launch` job: a snapshot in memory every 10 batches, a backup
    on disk every 500:

    >>> cb = jdist.BackupAndRestore(  # doctest: +SKIP
    ...     "/shared/backup", save_freq=500, snapshot_every=10)
  """

  def __init__(self, backup_dir, save_freq="epoch",
               delete_checkpoint: bool = True, max_to_keep: int = 2, *,
               snapshot_every: int | None = None):
    super().__init__()
    self.backup_dir = _check_directory(backup_dir, "BackupAndRestore")
    self.save_freq = _check_freq(save_freq)
    self.snapshot_every = manager_lib.check_steps("snapshot_every",
                                                  snapshot_every)
    manager_lib.launched_job(snapshot_every)
    self.delete_checkpoint = delete_checkpoint
    self.max_to_keep = max_to_keep
    self.restored_step = None
    self._manager = None  # the backups on disk, and the snapshots
    self._ckpt = None
    self._watcher = None

  def on_train_begin(self, logs=None):
    trainer = self.model
    self._manager = manager_lib.BackupManager(
        self.backup_dir, max_to_keep=self.max_to_keep,
        strategy=trainer.strategy, snapshot_every=self.snapshot_every)
    self._ckpt = self._manager.checkpointer
    like = trainer.strategy.state_placement.read(trainer.state)
    restored = self._manager.restore_from_memory(like)
    if restored is not None:
      where = f"the in-memory snapshot in {self._manager.snapshot_directory}"
    else:  # the newest backup, if any
      restored = self._ckpt.restore(like, trainer.strategy.mesh)
      where = self._ckpt.directory
    if restored is not None:
      state, meta = restored
      self.fit_loop.restore(state, meta)
      self.restored_step = trainer.global_step
      if is_chief():
        print(f"BackupAndRestore: resuming from step {trainer.global_step} "
              f"(epoch {meta['epoch'] + 1}, batch {meta['batch']}) in "
              f"{where}.", file=sys.stderr, flush=True)
    self._watcher = PreemptionWatcher()

  def on_train_batch_end(self, batch, logs=None):
    trainer = self.model
    if self._watcher.reached(trainer.global_step):
      self._watcher.handled()
      _save(self._ckpt, self)
      self.close()
      if is_chief():
        print(f"BackupAndRestore: preempted; saved step {trainer.global_step} "
              f"to {self.backup_dir}. Exiting; relaunch to resume.",
              file=sys.stderr, flush=True)
      raise SystemExit(0)
    if _save_due(self, self.save_freq):
      _save(self._ckpt, self)
    if self.snapshot_every is not None:
      self._manager.write_snapshot()  # the snapshot taken at an earlier batch
      if self.fit_loop.reached_multiple(self.snapshot_every):
        loop = self.fit_loop
        # (The next step donates the state's arrays: taking the snapshot
        # packs a copy of them, which the next batch's end writes.)
        self._manager.take_snapshot(
            loop.global_step, trainer.strategy.state_placement.read(
                trainer.state), loop.checkpoint_meta())

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq == "epoch":
      _save(self._ckpt, self)

  def close(self):
    self._let_go(delete=False)

  def _let_go(self, *, delete: bool):
    if self._watcher is not None:
      self._watcher.close()
      self._watcher = None
    if self._manager is not None:
      self._manager.close(delete=delete)
      self._manager = self._ckpt = None

  def on_train_end(self, logs=None):
    if self._ckpt is None:
      return
    bad = (nonfinite_leaves(self.model.strategy.state_placement.read(
        self.model.state))
           if self.delete_checkpoint else [])
    if bad and is_chief():
      print(f"BackupAndRestore: training ended with NaN or infinite values in "
            f"the train state ({bad[0]}, ...); the backups in "
            f"{self._ckpt.directory} are kept. Delete the directory to start "
            "over.", file=sys.stderr, flush=True)
    self._let_go(delete=self.delete_checkpoint and not bad)
