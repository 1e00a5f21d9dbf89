"""What a checkpoint of a training run holds, and continuing from one.

A checkpoint stores the `TrainState` (orbax arrays) and this metadata (JSON):
the position (epoch, batch within it, batches taken from the data), the
running sums of the epoch's loss and metrics when it stops mid-epoch, the
History so far, and what the data source needs to continue (a one-shot
iterator's state). Restoring all of it makes a resumed run end exactly where
an uninterrupted one would.
"""

from __future__ import annotations

from jdist._src.training import steps as steps_lib
from jdist._src.training.checkpoint import Checkpointer
from jdist._src.training.loop import Position
from jdist._src.training.state import TrainState


class Resumable:
  """The checkpoint side of `Trainer` (which supplies the attributes used)."""

  def checkpoint_meta(self) -> dict:
    """JSON metadata saved with a checkpoint: position, history, data state."""
    history = self.history.to_dict() if self.history else {}
    if self._epoch_logs is not None and history:
      epoch, logs = self._epoch_logs
      if epoch not in history["epoch"]:
        history["epoch"].append(epoch)
        for k, v in logs.items():
          history["history"].setdefault(k, []).append(v)
    pos = self._position
    sums = None
    if pos.batch and self._totals_now is not None:
      sums = steps_lib.read_sums(self.strategy, self._totals_now)
    data = self._source.state(pos.consumed) if self._source else {}
    return {"epoch": pos.epoch, "batch": pos.batch, "consumed": pos.consumed,
            "sums": sums, "history": history, "data": data}

  def restore_from(self, state: TrainState, meta: dict) -> None:
    """Continues from a restored checkpoint (used by `BackupAndRestore`)."""
    self.state = state
    self._global_step = int(meta["step"])
    self._position = Position(int(meta["epoch"]), int(meta["batch"]),
                              int(meta["consumed"]))
    self._resume_sums = meta.get("sums")
    if self.history is not None and meta.get("history"):
      self.history.load_dict(meta["history"])
    if self._source is not None:
      self._source.resume(meta.get("data") or {}, self._position.consumed)

  def load_checkpoint(self, directory, *, step: int | None = None) -> int:
    """Loads the weights and optimizer state of a checkpoint; returns its step.

    Reads checkpoints written by `ModelCheckpoint` or `BackupAndRestore`, on
    any number of devices or processes. Call `build(x)` first if the trainer
    has not run yet (the checkpoint must match the model's shapes).
    """
    self._require_state("load a checkpoint into")
    ckpt = Checkpointer(directory)
    try:
      restored = ckpt.restore(self.state, self.strategy.mesh, step=step)
    finally:
      ckpt.close()
    if restored is None:
      raise FileNotFoundError(f"No checkpoint in {directory}.")
    self.state, meta = restored
    self._global_step = int(meta["step"])
    return self._global_step

