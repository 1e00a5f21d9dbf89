"""`History`: the per-epoch logs a `fit` returns."""

from __future__ import annotations

from jdist._src.training.callbacks import Callback


class History(Callback):
  """Records each epoch's logs; `Trainer.fit` returns it.

  Attributes:
    history: `{name: [value per epoch]}` such as `loss`, `accuracy`,
      `val_loss`. Values are Python floats, the exact means over each epoch.
    epoch: the epoch indices recorded, in order.

  Example:
    >>> import jdist
    >>> h = jdist.History()
    >>> h.on_epoch_end(0, {"loss": 0.5})
    >>> h.history
    {'loss': [0.5]}
  """

  def __init__(self):
    super().__init__()
    self.history: dict[str, list] = {}
    self.epoch: list[int] = []

  def on_epoch_end(self, epoch: int, logs=None):
    self.epoch.append(epoch)
    for key, value in (logs or {}).items():
      self.history.setdefault(key, []).append(value)

  def to_dict(self) -> dict:
    """A JSON-able copy (used by checkpoints to restore the history)."""
    return {"epoch": list(self.epoch),
            "history": {k: list(v) for k, v in self.history.items()}}

  def load_dict(self, data: dict) -> None:
    """Replaces the records by those of `to_dict()`."""
    self.epoch = list(data.get("epoch", []))
    self.history = {k: list(v) for k, v in data.get("history", {}).items()}

  def __repr__(self) -> str:
    return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"
